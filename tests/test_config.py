"""Sizes, URIs and config files."""

from __future__ import annotations

import pytest

from ckptfs.config import Config, load_config_file, parse_s3_uri, parse_size
from ckptfs.errors import ConfigError


def test_sizes() -> None:
    assert parse_size("64MiB") == 64 * 1024**2
    assert parse_size("1GiB") == 1024**3
    assert parse_size("1.5GiB") == 1536 * 1024**2
    assert parse_size("100") == 100
    assert parse_size("10MB") == 10_000_000
    assert parse_size(4096) == 4096
    for bad in ("", "lots", "5 parsecs", "-1MiB"):
        with pytest.raises(ConfigError):
            parse_size(bad)


def test_uris() -> None:
    assert parse_s3_uri("s3://bucket") == ("bucket", "")
    assert parse_s3_uri("s3://bucket/") == ("bucket", "")
    assert parse_s3_uri("s3://bucket/a/b/") == ("bucket", "a/b/")
    assert parse_s3_uri("s3://bucket//a//b") == ("bucket", "a/b/")
    for bad in ("bucket/a", "s3:/bucket", "s3://", "s3://Bad_Bucket!", "s3://b/../x", "s3://ab"):
        with pytest.raises(ConfigError):
            parse_s3_uri(bad)


def test_config_file_keys(tmp_path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('source = "s3://b-1/p"\nmountpoint = "/mnt/x"\npart_size = "32MiB"\n'
                   'read_only = true\nconcurrency = 8\ncache_size = "2GiB"\n')
    values = load_config_file(str(cfg))
    config = Config(**values).validate()  # type: ignore[arg-type]
    assert config.part_size == 32 * 1024**2 and config.read_only and config.concurrency == 8
    assert config.bucket == "b-1" and config.prefix == "p/"
    assert config.cache_size == 2 * 1024**3
    cfg.write_text('read_only = "yes"\n')
    with pytest.raises(ConfigError, match="true or false"):
        load_config_file(str(cfg))
    cfg.write_text('metadata_tll = 5\n')
    with pytest.raises(ConfigError, match="unknown key 'metadata_tll'"):
        load_config_file(str(cfg))


def test_endpoint_from_environment(monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert Config("s3://bucket", "/mnt").validate().endpoint_url == "http://127.0.0.1:9"
    assert Config("s3://bucket", "/mnt", endpoint_url="http://x").validate().endpoint_url == "http://x"


def test_memory_budgets() -> None:
    config = Config("s3://bucket", "/mnt", upload_memory=96 * 1024**2).validate()
    assert config.upload_memory == 96 * 1024**2 and config.read_memory == 48 * 1024**2
    with pytest.raises(ConfigError, match="--upload-memory must be at least 5MiB"):
        Config("s3://bucket", "/mnt", upload_memory=1024).validate()
    with pytest.raises(ConfigError, match="--read-memory must be at least 16MiB"):
        Config("s3://bucket", "/mnt", read_memory=1024).validate()
