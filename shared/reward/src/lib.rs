//! rule-based reward scorers (verl default_compute_score parity)
