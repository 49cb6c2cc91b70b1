"""The parity checks' maths: traces, log-probabilities, and GSM8K's data, scoring and gate."""
