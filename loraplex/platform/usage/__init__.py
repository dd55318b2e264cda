"""Usage metering and billing: a durable spool, an idempotent ledger, plans and prices, quotas, exports."""
