"""Plugin and engine options (:mod:`transport.options`): ``key=value`` strings become
the option Structs of the weights plugin, the disk plugin and the hf engine, and a bad
key or value is one line that names it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
import pytest

from transport.options import (
    NonEmptyStr,
    NonNegative,
    NonNegativeSeconds,
    Port,
    Positive,
    Seconds,
    UnknownOption,
    configure,
    parse_options,
    resolve_entry,
)


class Opts(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(min_length=1)]
    on: bool = True
    wait: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    count: Annotated[int, msgspec.Meta(ge=1)] | None = None
    mode: Literal["a", "b"] = "a"


def test_strings_become_the_field_types() -> None:
    o = parse_options(
        {"name": "x", "on": "off", "wait": "0.5", "count": "3", "mode": "b"}, Opts, "opt"
    )
    assert o == Opts(name="x", on=False, wait=0.5, count=3, mode="b")
    for word, value in [("1", True), ("TRUE", True), ("yes", True), ("0", False), ("No", False)]:
        assert parse_options({"name": "x", "on": word}, Opts, "opt").on is value
    # An empty value is the default; values already typed pass as they are.
    assert parse_options({"name": "x", "wait": "", "count": 2}, Opts, "opt").wait == 1.0


@pytest.mark.parametrize(
    ("opts", "line"),
    [
        ({}, "opt 'name' is required"),
        ({"name": "x", "nmae": "y"}, "unknown opt 'nmae'; known: name, on, wait, count, mode"),
        ({"name": "x", "on": "maybe"}, "opt on='maybe': expected a boolean"),
        ({"name": "x", "wait": "soon"}, "opt wait='soon': expected a number"),
        ({"name": "x", "wait": "0"}, "opt wait='0': expected a number > 0"),
        ({"name": "x", "count": "2.5"}, "opt count='2.5': expected an integer"),
        ({"name": "x", "mode": "c"}, "opt mode='c': expected one of a, b"),
    ],
)
def test_a_bad_key_or_value_is_one_line_naming_it(opts: dict[str, str], line: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_options(opts, Opts, "opt")
    message = str(info.value)
    assert line in message and "\n" not in message and "$." not in message


class Shared(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: NonEmptyStr = "n"
    count: Positive = 1
    spare: NonNegative = 0
    wait: Seconds = 1.0
    backoff: NonNegativeSeconds = 0.0
    port: Port = 0


@pytest.mark.parametrize(
    ("opts", "line"),
    [
        ({"name": ""}, None),  # empty: the default
        ({"count": "0"}, "o count='0': expected an integer >= 1"),
        ({"spare": "-1"}, "o spare='-1': expected an integer >= 0"),
        ({"wait": "0"}, "o wait='0': expected a number > 0"),
        ({"backoff": "-0.5"}, "o backoff='-0.5': expected a number >= 0"),
        ({"port": "65536"}, "o port='65536': expected an integer <= 65535"),
        ({"port": "-1"}, "o port='-1': expected an integer >= 0"),
    ],
)
def test_the_shared_constraint_aliases_hold(opts: dict[str, str], line: str | None) -> None:
    if line is None:
        assert parse_options(opts, Shared, "o") == Shared()
        return
    with pytest.raises(ValueError) as info:
        parse_options(opts, Shared, "o")
    assert line in str(info.value)
    good = {"count": "2", "spare": "0", "wait": "0.5", "backoff": "0", "port": "65535"}
    assert parse_options(good, Shared, "o") == Shared(count=2, wait=0.5, port=65535)
    with pytest.raises(msgspec.ValidationError):  # and on decode, not only from strings
        msgspec.json.decode(b'{"name": ""}', type=Shared)


def test_a_prefix_leaves_other_plugins_keys_alone() -> None:
    class Disk(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
        disk_root: str

    assert parse_options({"disk_root": "/r", "x": "1"}, Disk, "o", prefix="disk_").disk_root
    with pytest.raises(ValueError, match="unknown o 'disk_dir'"):
        parse_options({"disk_root": "/r", "disk_dir": "1"}, Disk, "o", prefix="disk_")


def test_entry_points_resolve_or_name_what_is_wrong() -> None:
    import os.path

    assert resolve_entry("os.path:join", "--x") is os.path.join
    for spec, words in [
        ("os.path", "--x 'os.path': expected module:name"),
        ("no_such_module_x:f", "--x 'no_such_module_x:f': cannot import no_such_module_x"),
        ("os:no_such_name", "--x 'os:no_such_name': os has no 'no_such_name'"),
    ]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(")):
            resolve_entry(spec, "--x")


# -- the three users ------------------------------------------------------------------
WEIGHTS = {"weights_endpoint": "tcp://127.0.0.1:1"}


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        ({"weights_shm": "maybe"}, "weights plugin option weights_shm='maybe': expected a boolean"),
        ({"weights_pause_lease": "-1"}, "weights_pause_lease='-1': expected a number >= 0"),
        ({"weights_path": "udp"}, "weights_path='udp': expected one of ipc, shm, tcp"),
        ({"weights_pause_timeout": "soon"}, "weights_pause_timeout='soon': expected a number"),
        ({"weigths_shm": "0"}, "unknown weights plugin option 'weigths_shm'; known: weights_"),
        ({"weights_rename": '{"a": 1}'}, "weights_rename: not a JSON object of names"),
        ({"weights_loader": "os:no_such_fn"}, "weights_loader 'os:no_such_fn': os has no"),
    ],
)
def test_weights_plugin_options(extra: dict[str, str], line: str) -> None:
    pytest.importorskip("torch")
    from transport.weights.update import subscriber_options

    with pytest.raises(ValueError) as info:
        subscriber_options({**WEIGHTS, **extra}, None)
    assert line in str(info.value) and "\n" not in str(info.value)


def test_weights_plugin_options_keep_their_defaults() -> None:
    pytest.importorskip("torch")
    from transport.weights.update import PLUGIN_OPTIONS, subscriber_options

    assert subscriber_options(WEIGHTS, None) == {
        "shm": True,
        "report_digest": False,
        "strict": True,
    }
    kw = subscriber_options(
        {**WEIGHTS, "weights_shm": "off", "weights_pause_lease": "2.5", "weights_path": "tcp",
         "weights_atomic": "1", "weights_rename": '{"a": "b"}', "weights_digest": "true"},
        None,
    )  # fmt: skip
    assert kw == {
        "shm": False, "report_digest": True, "strict": True, "path": "tcp", "atomic": True,
        "pause_lease": 2.5, "rename": {"a": "b"},
    }  # fmt: skip
    assert "weights_curve_server" in PLUGIN_OPTIONS and len(PLUGIN_OPTIONS) == 15


@pytest.mark.parametrize(
    ("opts", "line"),
    [
        ({"disk_root": "/x", "disk_poll": "soon"}, "disk plugin option disk_poll='soon': expected a number"),
        ({"disk_root": "/x", "disk_dir": "/y"}, "unknown disk plugin option 'disk_dir'; known: disk_root"),
    ],
)  # fmt: skip
def test_disk_plugin_options(opts: dict[str, str], line: str) -> None:
    pytest.importorskip("torch")
    from transport.weights.disk_follow import DiskOptions

    with pytest.raises(ValueError) as info:
        parse_options(opts, DiskOptions, "disk plugin option", prefix="disk_")
    assert line in str(info.value) and "\n" not in str(info.value)
    o = parse_options({"disk_root": "/x", "weights_shm": "0"}, DiskOptions, "d", prefix="disk_")
    assert (o.root, o.poll, o.pause_timeout, o.strict) == ("/x", 0.05, 30.0, True)


@pytest.mark.parametrize(
    ("opts", "line"),
    [
        ({"max_batch": "many"}, "hf engine option max_batch='many': expected an integer"),
        ({"max_batch": "0"}, "hf engine option max_batch='0': expected an integer >= 1"),
        ({"dtype": "float8"}, "dtype='float8': expected one of float32, float16, bfloat16"),
        ({"batch": "3"}, "unknown hf engine option 'batch'; known: model_size"),
    ],
)
def test_hf_engine_options(opts: dict[str, Any], line: str) -> None:
    pytest.importorskip("torch")
    from transport.hf_engine import create_engine

    with pytest.raises(ValueError) as info:
        create_engine("tiny", device="cpu", **opts)
    assert line in str(info.value) and "\n" not in str(info.value)


def test_configure_applies_settings_to_a_config_and_names_a_bad_one() -> None:
    base = Opts(name="x", wait=2.0)
    assert configure(Opts, base, {"count": "3"}, "opt") == Opts(name="x", wait=2.0, count=3)
    assert configure(Opts, None, {"name": "y"}, "opt") == Opts(name="y")
    assert base == Opts(name="x", wait=2.0)  # a new config; the given one is unchanged
    with pytest.raises(UnknownOption, match="unknown opt 'nmae'; known: name, on") as info:
        configure(Opts, base, {"nmae": "y"}, "opt")
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match="opt wait=0: expected a number > 0"):
        configure(Opts, base, {"wait": 0}, "opt")
    with pytest.raises(TypeError, match="config must be a Opts, got dict"):
        configure(Opts, {"name": "x"}, {}, "opt")  # type: ignore[type-var]


def test_the_controller_reads_its_settings_through_one_config() -> None:
    from transport import ControllerConfig, FabricController

    with FabricController((), timeout=5, max_message_size=1 << 20) as ctl:
        assert ctl.config == ControllerConfig(timeout=5.0, max_message_size=1 << 20)
        assert ctl.timeout == 5.0
    with FabricController((), ControllerConfig(timeout=7), timeout="9") as ctl:
        assert ctl.timeout == 9.0  # keywords override the config
    with pytest.raises(ValueError, match="controller option timeout=-1: expected a number > 0"):
        FabricController((), timeout=-1)
    with pytest.raises(TypeError, match="unknown controller option 'timout'"):
        FabricController((), timout=5)


def test_configure_keeps_an_empty_string_a_config_holds() -> None:
    class Named(msgspec.Struct, kw_only=True):
        label: str = "default"

    assert configure(Named, Named(label=""), {}, "opt").label == ""  # not the default
    assert configure(Named, None, {"label": ""}, "opt").label == ""
