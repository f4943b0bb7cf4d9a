use async_bulkhead_llm::*;
fn main() {
    let b = LlmBulkhead::builder("m", 1024)
        .token_budget(TokenBudget::new(1 << 34))
        .build()
        .unwrap();
    let opts = AcquireOptions::new().reservation(Reservation::new(100, 1000).unwrap());
    let req = LlmRequest::new();
    let n: u64 = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(30_000_000);
    let t = std::time::Instant::now();
    for _ in 0..n {
        drop(std::hint::black_box(
            b.try_acquire(&req, std::hint::black_box(opts)),
        ));
    }
    eprintln!("budget {:.1} ns", t.elapsed().as_nanos() as f64 / n as f64);
}
