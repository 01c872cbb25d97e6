"""The local S3 server of the tests, demo and benches (devtools/devserver.py)."""

from __future__ import annotations

import pytest

from devtools import devserver


@pytest.mark.parametrize("bucket", ["ab", "Checkpoints", "ckpt_fs", "-ckpt", "x" * 64])
def test_a_name_s3_would_refuse_is_refused_before_the_server_starts(tmp_path, bucket) -> None:
    # weed mini creates no such bucket, and start() used to wait 90 s for it to answer.
    with pytest.raises(ValueError, match="not an S3 bucket name"):
        devserver.start(str(tmp_path / "weed"), bucket=bucket)
    assert not (tmp_path / "weed").exists()  # nothing was started
