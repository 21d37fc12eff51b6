"""One serving configuration (issue 47, item 4): :class:`attnx.runtime.config.ServingConfig` is where every setting
of ``attnx serve`` lives, with its default, help and check; ``serve --help`` and ``bench --help`` are generated from
it, ``InferenceServer`` takes it whole, and a bad value is one line naming its flag."""

from __future__ import annotations

import dataclasses
import re

import pytest
from attnx.cli.main import app
from attnx.runtime.config import ConfigError, ServingConfig, settings
from support.cli import one_line_error
from support.cli import run as attnx

#: The flags `attnx serve` had before the options were generated, with their defaults (users' scripts pass them).
SERVE_FLAGS_BEFORE = {"--host": "127.0.0.1", "--port": 8000, "--grpc-port": None, "--log-level": "warning",
                      "--api-key": None, "--device": "auto", "--threads": None, "--max-batch": 32,
                      "--max-delay-ms": 2.0, "--max-queue": 1024, "--timeout-ms": 30000.0, "--max-length-ratio": 1.5,
                      "--max-batch-tokens": 8192, "--max-body-mb": 64.0, "--body-timeout-s": 10.0,
                      "--min-body-rate-kb": 16.0, "--max-seq": None, "--max-inputs": 1024,
                      "--max-request-tokens": 300000, "--max-positions": None, "--max-new-tokens": None,
                      "--max-header-kb": 64.0, "--max-headers": 100, "--head-timeout-s": 10.0}
#: `attnx bench`'s in-process batcher flags before, and their defaults (its token cap was off).
BENCH_FLAGS_BEFORE = {"--device": "auto", "--threads": None, "--max-batch": 32, "--max-delay-ms": 2.0,
                      "--max-queue": 1024, "--max-length-ratio": 1.5, "--max-batch-tokens": 0}


def _click_options(command: str) -> dict[str, object]:
    import typer

    cmd = typer.main.get_command(app).get_command(None, command)
    return {opt: p.default for p in cmd.params for opt in p.opts if opt.startswith("--")}


def _help_lines(command: str) -> dict[str, str]:
    """``--flag`` -> its whole entry in the rendered ``--help`` (an entry's wrapped lines joined)."""
    result = attnx(command, "--help", env={"COLUMNS": "400"})
    assert result.returncode == 0, result.output
    entries: dict[str, str] = {}
    current = None
    for line in result.stdout.splitlines():
        cell = line.strip("│ ")
        match = re.match(r"(--[a-z0-9-]+)\s", cell)
        if match:
            current = match.group(1)
            entries[current] = cell
        elif current and cell:
            entries[current] += " " + cell
    return entries


@pytest.mark.parametrize("command, flags_before", [("serve", SERVE_FLAGS_BEFORE), ("bench", BENCH_FLAGS_BEFORE)])
def test_every_setting_is_an_option_in_help_with_its_default(command, flags_before):
    options, entries = _click_options(command), _help_lines(command)
    fields = list(settings(command))
    assert {f.name for f, _ in fields} >= {flag[2:].replace("-", "_") for flag in flags_before}
    for f, setting in fields:
        flag = "--" + f.name.replace("_", "-")
        default = flags_before.get(flag, f.default)
        assert options[flag] == default, (flag, options[flag])
        assert flag in entries, flag
        if default is not None and not setting.secret:
            assert f"[default: {default}]" in entries[flag], (flag, entries[flag])
        assert setting.help.split("(")[0].strip()[:30] in entries[flag], (flag, entries[flag])
    # what is not a serving setting (files, per-model folders, the load itself) is still declared by the command
    own = {"serve": ["--tokenizer", "--chat-template", "--dimensions", "--describe", "--batch-axis"],
           "bench": ["--url", "--concurrency", "--text", "--rounds"]}[command]
    assert all(flag in entries for flag in own)


def test_bench_takes_only_the_settings_its_in_process_batcher_reads():
    bench = _click_options("bench")
    assert "--max-body-mb" not in bench and "--port" not in bench and "--api-key" not in bench


@pytest.mark.parametrize("args, words", [
    (["serve", "--max-seq", "0"], "--max-seq must be >= 1, got 0"),
    (["serve", "--log-level", "loud"], "--log-level must be one of critical, error, warning, info, debug, trace"),
    (["serve", "--max-length-ratio", "0.5"], "--max-length-ratio must be >= 1 (or 0: pad anything), got 0.5"),
    (["serve", "--max-header-kb", "0"], "--max-header-kb must be positive, got 0.0"),
    (["serve", "--device", "tpu"], "--device must be one of auto, cpu, cuda, got 'tpu'"),
    (["bench", "--max-batch", "0"], "--max-batch must be >= 1, got 0"),
    (["bench", "--max-batch-tokens", "-1"], "--max-batch-tokens must be >= 0, got -1"),
])
def test_a_bad_setting_is_one_line_naming_its_flag_before_any_model_is_looked_for(tmp_path, args, words):
    # tmp_path holds no export: the setting is refused first, not "no ONNX export found"
    line = one_line_error(attnx(*args, cwd=tmp_path, env={"ATTNX_WORKDIR": str(tmp_path)}), words, code=2,
                          alone=True)
    assert "export" not in line


def test_the_library_refuses_the_same_values_in_one_line():
    for values, message in (({"max_seq": 0}, "max_seq must be >= 1, got 0"),
                            ({"port": 70000}, "port must be 0..65535, got 70000"),
                            ({"threads": "2"}, "threads must be an integer, got '2'"),
                            ({"max_batch": True}, "max_batch must be an integer, got True"),
                            ({"api_key": " "}, "api_key is refused: the API key is empty"),
                            ({"max_body_mb": 1e-9}, "max_body_bytes must be a positive integer, got 0")):
        with pytest.raises(ConfigError) as info:
            ServingConfig(**values)
        assert message in str(info.value) and "\n" not in str(info.value)


def test_each_layer_gets_its_part_and_back():
    """The layers keep their own value types; the config sets every field of them (HttpLimits' descriptor reserve
    excepted) and ``from_parts`` is the exact inverse."""
    from attnx.runtime.core.batcher import BatcherConfig
    from attnx.runtime.wire.http_guard import HttpLimits
    from attnx.runtime.wire.limits import Limits

    config = ServingConfig(max_body_mb=1.5, min_body_rate_kb=0, timeout_ms=0, max_length_ratio=0, max_header_kb=8,
                           max_batch_tokens=0, max_inputs=7, max_decode_mb=3)
    assert config.limits.max_body_bytes == 3 << 19 and config.limits.min_body_rate is None
    assert config.limits.max_texts == 7 and config.limits.max_decode_bytes == 3 << 20
    assert config.batching.timeout_ms is None and config.batching.max_length_ratio is None
    assert config.batching.max_batch_tokens is None and config.http_limits.max_header_bytes == 8 << 10
    assert ServingConfig().batching.max_batch_tokens == 8192 and ServingConfig().limits == Limits()
    covered = {(s.part, s.key or f.name) for f, s in settings() if s.part}
    for part, cls in (("batching", BatcherConfig), ("limits", Limits), ("http", HttpLimits)):
        names = {f.name for f in dataclasses.fields(cls)} - {"fd_reserve"}
        assert {(part, n) for n in names} <= covered, part
    batching = BatcherConfig(max_batch_size=3, max_queue_delay_ms=7.5, timeout_ms=None, max_batch_tokens=100)
    limits = Limits(max_body_bytes=12345, min_body_rate=1000, max_decode_bytes=777, max_request_tokens=None,
                    max_messages=9, decode_wait_s=0.2)
    http = HttpLimits(max_header_bytes=3000, max_headers=5, head_timeout_s=0.5)
    back = ServingConfig.from_parts(batching=batching, limits=limits, http_limits=http, port=0)
    assert (back.batching, back.limits, back.http_limits, back.port) == (batching, limits, http, 0)


def test_the_api_key_is_never_shown():
    config = ServingConfig(api_key="s3cret")
    assert "s3cret" not in repr(config)
    assert "s3cret" not in _help_lines("serve")["--api-key"]
