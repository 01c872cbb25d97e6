"""ckptfs: an S3 prefix as a local directory, built for training checkpoints."""

__version__ = "0.1.0"
