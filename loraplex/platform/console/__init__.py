"""The admin console at ``/console``: server-rendered pages for operators and tenants."""
