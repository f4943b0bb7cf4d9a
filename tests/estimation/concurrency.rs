//! Estimators shared by several threads.

use std::collections::HashSet;
use std::sync::Arc;

use async_bulkhead_llm::estimate::Estimator;

use crate::support::{adaptive, models, request, usage};

#[test]
fn adaptive_shared_by_eight_threads_stays_bounded_and_converges() {
    const MAX_MODELS: usize = 4;
    const THREADS: usize = 8;
    const ROUNDS: usize = 2_000;
    let adaptive = Arc::new(adaptive(0.3, 2, (0.5, 2.0), MAX_MODELS));
    let names: Vec<String> = (0..10).map(|i| format!("Model-{i:02}")).collect();
    let lowercased: HashSet<String> = names.iter().map(|n| n.to_lowercase()).collect();

    let start = std::sync::Barrier::new(THREADS);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let adaptive = Arc::clone(&adaptive);
            let names = &names;
            let start = &start;
            s.spawn(move || {
                start.wait();
                for round in 0..ROUNDS {
                    let name = &names[(t * 3 + round * 7) % names.len()];
                    let name = if round % 2 == 0 {
                        name.to_uppercase()
                    } else {
                        name.clone()
                    };
                    let req = request(&name, 400); // unknown: 4.0, base input 100
                    let estimate = adaptive.estimate(&req).unwrap();
                    assert!(
                        estimate.input == 100 || estimate.input == 125,
                        "{estimate:?}"
                    );
                    assert_eq!(estimate.max_output, 2048);
                    // A constant 1.25x.
                    if round % 3 == 0 {
                        adaptive.observe_request(&req, usage(125, 9)).unwrap();
                    } else {
                        adaptive.observe(&estimate, usage(125, 9));
                    }
                    if round % 16 == 0 {
                        let corrections = adaptive.corrections();
                        assert!(corrections.len() <= MAX_MODELS, "{corrections:?}");
                        for c in corrections {
                            assert_eq!(c.factor, 1.25, "{c:?}");
                        }
                    }
                    if t == 0 && round % 100 == 99 {
                        adaptive.reset(Some(&name));
                    }
                }
            });
        }
    });

    let corrections = adaptive.corrections();
    assert!(!corrections.is_empty());
    assert!(corrections.len() <= MAX_MODELS, "{corrections:?}");
    let distinct: HashSet<&str> = corrections.iter().map(|c| c.model.as_str()).collect();
    assert_eq!(distinct.len(), corrections.len(), "no model tracked twice");
    for c in &corrections {
        assert!(lowercased.contains(&c.model), "{c:?}");
        assert!(c.samples >= 1);
        assert_eq!(c.factor, 1.25, "{c:?}");
        let (applied, input) = if c.samples >= 2 {
            (1.25, 125)
        } else {
            (1.0, 100)
        };
        assert_eq!(c.applied, applied, "{c:?}");
        assert_eq!(
            adaptive.estimate(&request(&c.model, 400)).unwrap().input,
            input
        );
    }
    // Still fully usable afterwards: a new model evicts the oldest survivor.
    let oldest = corrections[0].model.clone();
    adaptive
        .observe_request(&request("fresh-model", 400), usage(150, 0))
        .unwrap();
    let after = models(&adaptive);
    assert!(after.len() <= MAX_MODELS);
    assert_eq!(after.last().map(String::as_str), Some("fresh-model"));
    if corrections.len() == MAX_MODELS {
        assert!(!after.contains(&oldest), "{after:?}");
    }
}
