"""Where finished exports are kept: ``file://`` (files.py) or ``s3://`` (s3.py)."""
