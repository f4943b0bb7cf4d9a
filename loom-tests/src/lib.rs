//! Intentionally empty: the models live in `tests/` and only build under `--cfg loom`.
