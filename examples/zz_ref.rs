use async_bulkhead_llm::*;
fn main() {
    let req = LlmRequest::new();
    let n: u64 = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(20_000_000);
    let full = LlmBulkhead::builder("m", 0).build().unwrap();
    let t = std::time::Instant::now();
    for _ in 0..n {
        drop(std::hint::black_box(full.try_acquire(
            &req,
            std::hint::black_box(AcquireOptions::new()),
        )));
    }
    eprintln!("refusal {:.1} ns", t.elapsed().as_nanos() as f64 / n as f64);
}
