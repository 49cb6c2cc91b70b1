"""The evidence directory's primitives: ids, atomic writes, stage records, locks, privacy, the gate table."""
