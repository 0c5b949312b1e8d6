"""The Redis ledger: one budget shared by every process and host."""
