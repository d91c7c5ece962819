"""The launch table (kernels/fused/launch_config.py): MHC_KERNEL_CONFIG's overrides and the interpreter's tiles."""

import copy
import json
import os
import subprocess
import sys

import pytest
from kernel_checks import CUDA  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)

from mhc_lightning.kernels.fused import host, launch_config


def _imported(value):
    """The launch table as a fresh interpreter process sees it with MHC_KERNEL_CONFIG=value."""
    code = "import json; from mhc_lightning.kernels.fused import launch_config; print(json.dumps(launch_config.CONFIG))"
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, MHC_KERNEL_CONFIG=value, TRITON_INTERPRET="1"),
    )


def test_kernel_config_override_from_the_environment():
    """MHC_KERNEL_CONFIG merges into CONFIG at import (nested tile sets key by key), after the interpreter's tiles."""
    proc = _imported(
        '{"coef_fwd": {"BC": 32, "pairs": {"BT": 32}}, "post_bwd": {"rows": {"BT": 2}},'
        ' "coef_bwd_x": {"loop_stages": null}}'
    )
    assert proc.returncode == 0, proc.stderr
    config = json.loads(proc.stdout)
    cfg = config["coef_fwd"]
    assert cfg["BC"] == 32 and cfg["pairs"]["BT"] == 32
    assert cfg["pairs"]["BK"] == launch_config.CONFIG["coef_fwd"]["pairs"]["BK"]  # the rest of the nested entry kept
    assert config["coef_bwd_x"]["loop_stages"] is None
    tile = launch_config.INTERPRETER_TILES["post_bwd"]["BT"]
    assert config["post_bwd"]["rows"]["BT"] == 2 and config["post_bwd"]["BT"] == tile == config["coef_bwd_tok"]["BT"]


def test_kernel_config_refuses_what_the_table_does_not_hold():
    """A kernel or key the table does not have (the retired switches among them), a value that is not a number, or
    text that is not JSON is refused with one line naming it and what is allowed; at import, the import stops."""
    allowed_fwd = ", ".join(launch_config.CONFIG["coef_fwd"])
    for value, words in (
        ('{"coef_fwdx": {}}', "MHC_KERNEL_CONFIG: unknown kernel 'coef_fwdx'; allowed: coef_fwd, rms_proj,"),
        (
            '{"coef_fwd": {"phi_split": true}}',
            f"MHC_KERNEL_CONFIG.coef_fwd: unknown key 'phi_split'; allowed: {allowed_fwd}",
        ),
        (
            '{"coef_fwd": {"pairs": {"split_tail": false}}}',
            "MHC_KERNEL_CONFIG.coef_fwd.pairs: unknown key 'split_tail'; allowed: BT, BK,",
        ),
        ('{"launch": {"fast": false}}', "MHC_KERNEL_CONFIG: unknown kernel 'launch'; allowed:"),
        ('{"coef_bwd_x": {"BT": "64"}}', "MHC_KERNEL_CONFIG.coef_bwd_x.BT: '64' is not a number"),
        ('{"coef_bwd_x": {"BT": true}}', "MHC_KERNEL_CONFIG.coef_bwd_x.BT: True is not a number"),
        ('{"coef_bwd_x": 4}', "MHC_KERNEL_CONFIG.coef_bwd_x: expected an object of launch-table keys, got 4"),
        ("{coef", "MHC_KERNEL_CONFIG is not JSON"),
    ):
        before = copy.deepcopy(launch_config.CONFIG)
        with pytest.raises(ValueError) as err:
            launch_config.apply_environment(value)
        assert words in str(err.value) and "\n" not in str(err.value), (value, str(err.value))
        assert launch_config.CONFIG == before  # nothing merged before the refusal
    proc = _imported('{"coef_bwd_x": {"dphi_first": true}}')
    assert proc.returncode != 0
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "MHC_KERNEL_CONFIG.coef_bwd_x: unknown key 'dphi_first'; allowed: "
            + ", ".join(launch_config.CONFIG["coef_bwd_x"])
        )
    )


def test_interpreter_tiles_only_under_the_interpreter():
    """INTERPRETER_TILES (32 tokens per program) replace CONFIG's token tiles under the interpreter only: compiled
    kernels keep the tiles the GPU measurements chose (one row per program in post_bwd's rows tile)."""
    for name, tiles in launch_config.INTERPRETER_TILES.items():
        for key, value in tiles.items():
            if isinstance(value, dict):
                assert all((launch_config.CONFIG[name][key][k] == v) == host.INTERPRET for k, v in value.items())
            else:
                assert (launch_config.CONFIG[name][key] == value) == host.INTERPRET, (name, key)


def test_the_table_holds_numbers_only():
    """Every entry's values are numbers (null: Triton's default pipelining depth) or nested tile sets of numbers."""

    def numbers(entry):
        return all(
            isinstance(v, int)
            and not isinstance(v, bool)
            or (v is None and k == "loop_stages")
            or isinstance(v, dict)
            and numbers(v)
            for k, v in entry.items()
        )

    assert all(numbers(entry) for entry in launch_config.CONFIG.values())
