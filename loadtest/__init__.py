"""Load testing: locust scenarios and reports."""
