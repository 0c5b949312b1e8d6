"""The budget ledgers: the contract, the in-process ledger, fair share, forecasts, and Redis."""
