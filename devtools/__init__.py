"""Tools for developing ckptfs, not shipped with it: the local S3 server (SeaweedFS) that the
tests, the demo and the benchmarks run against."""
