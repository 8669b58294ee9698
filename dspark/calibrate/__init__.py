"""`python -m dspark.calibrate`: fit Sequential Temperature Scaling for a DSpark checkpoint."""
