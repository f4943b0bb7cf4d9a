//! Reservation::new, Reservation::with_reserved, TokenUsage::new, TokenEstimate::reservation

use async_bulkhead_llm::{
    Reservation, TokenUsage, estimate::TokenEstimate, limits::MAX_BUDGET, request::RequestError,
    usage::UsageError,
};

#[test]
fn reservation_new_refuses_sums_that_overflow() {
    let ok: [(u64, u64); 6] = [
        (0, 0),
        (u64::MAX, 0),
        (0, u64::MAX),
        (u64::MAX - 1, 1),
        (1, u64::MAX - 1),
        (MAX_BUDGET, MAX_BUDGET),
    ];
    for (input, max_output) in ok {
        let r = Reservation::new(input, max_output).unwrap();
        assert_eq!(
            (r.input(), r.max_output(), r.reserved()),
            (input, max_output, input + max_output)
        );
        assert_eq!(TokenEstimate::new(input, max_output).reservation(), Ok(r));
    }
    let overflowing: [(u64, u64); 5] = [
        (u64::MAX, 1),
        (1, u64::MAX),
        (u64::MAX, u64::MAX),
        (u64::MAX - 1, 2),
        (u64::MAX / 2 + 1, u64::MAX / 2 + 1),
    ];
    for (input, max_output) in overflowing {
        let expected = RequestError::ReservationOverflow { input, max_output };
        assert_eq!(Reservation::new(input, max_output), Err(expected));
        assert_eq!(
            TokenEstimate::new(input, max_output).reservation(),
            Err(expected)
        );
        assert_eq!(
            expected.to_string(),
            format!(
                "token reservation ({input} input + {max_output} max output) does not fit in 64 bits"
            )
        );
    }
}

#[test]
fn reservation_with_reserved_refuses_inconsistent_totals() {
    let cases: [(u64, u64, u64, Result<u64, RequestError>); 12] = [
        (100, 1000, 1100, Ok(1100)),
        (0, 0, 0, Ok(0)),
        (u64::MAX, 0, u64::MAX, Ok(u64::MAX)),
        (u64::MAX - 1, 1, u64::MAX, Ok(u64::MAX)),
        (
            100,
            1000,
            999,
            Err(RequestError::ReservedMismatch {
                reserved: 999,
                input: 100,
                max_output: 1000,
            }),
        ),
        (
            100,
            1000,
            1101,
            Err(RequestError::ReservedMismatch {
                reserved: 1101,
                input: 100,
                max_output: 1000,
            }),
        ),
        (
            1,
            2,
            0,
            Err(RequestError::ReservedMismatch {
                reserved: 0,
                input: 1,
                max_output: 2,
            }),
        ),
        (
            0,
            0,
            u64::MAX,
            Err(RequestError::ReservedMismatch {
                reserved: u64::MAX,
                input: 0,
                max_output: 0,
            }),
        ),
        (
            u64::MAX - 1,
            0,
            u64::MAX,
            Err(RequestError::ReservedMismatch {
                reserved: u64::MAX,
                input: u64::MAX - 1,
                max_output: 0,
            }),
        ),
        // An overflowing sum is reported as such, whatever `reserved` says.
        (
            u64::MAX,
            1,
            0,
            Err(RequestError::ReservationOverflow {
                input: u64::MAX,
                max_output: 1,
            }),
        ),
        (
            u64::MAX,
            1,
            u64::MAX,
            Err(RequestError::ReservationOverflow {
                input: u64::MAX,
                max_output: 1,
            }),
        ),
        (
            u64::MAX,
            u64::MAX,
            u64::MAX - 1,
            Err(RequestError::ReservationOverflow {
                input: u64::MAX,
                max_output: u64::MAX,
            }),
        ),
    ];
    for (input, max_output, reserved, expected) in cases {
        let got = Reservation::with_reserved(input, max_output, reserved);
        assert_eq!(
            got.map(|r| r.reserved()),
            expected,
            "({input}, {max_output}, {reserved})"
        );
    }
    // Display of the mismatch (design §U16, snake_case in Rust).
    assert_eq!(
        Reservation::with_reserved(100, 1000, 999)
            .unwrap_err()
            .to_string(),
        "reservation.reserved (999) must equal reservation.input + reservation.max_output (1100)"
    );
    assert_eq!(
        Reservation::with_reserved(0, 0, u64::MAX)
            .unwrap_err()
            .to_string(),
        "reservation.reserved (18446744073709551615) must equal reservation.input + reservation.max_output (0)"
    );
}

#[test]
fn token_usage_new_refuses_totals_that_overflow() {
    for (input, output) in [(0, 0), (u64::MAX, 0), (0, u64::MAX), (u64::MAX - 1, 1)] {
        let u = TokenUsage::new(input, output).unwrap();
        assert_eq!(u.total(), input + output);
    }
    for (input, output) in [(u64::MAX, 1), (1, u64::MAX), (u64::MAX, u64::MAX)] {
        let err = TokenUsage::new(input, output).unwrap_err();
        assert_eq!(err, UsageError::TotalOverflow { input, output });
        assert_eq!(
            err.to_string(),
            format!("token usage total ({input} input + {output} output) does not fit in 64 bits")
        );
        assert!(
            err.to_string().starts_with("token usage"),
            "design §U16: /token usage/"
        );
    }
}
