"""The command line: ``python -m scripts.ollama_stub --port P`` (see ``--help``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import uvicorn

from .common import normalize_model
from .directives import StubConfig
from .models import DEFAULT_CONTEXT_LENGTH, KNOWN_CAPABILITIES, ModelCatalogue
from .quirks import QUIRKS
from .server import StubServer, bind_socket, build_app


def _named_list_arg(text: str) -> tuple[str, tuple[str, ...]]:
    name, sep, values = text.partition("=")
    capabilities = tuple(v.strip() for v in values.split(",") if v.strip())
    unknown = sorted(set(capabilities) - set(KNOWN_CAPABILITIES))
    if not sep or not name or unknown:
        raise argparse.ArgumentTypeError(
            f"expected NAME=CAP[,CAP...] of {', '.join(KNOWN_CAPABILITIES)}, got {text!r}")
    return normalize_model(name), capabilities


def _named_int_arg(text: str) -> tuple[str, int]:
    name, sep, number = text.partition("=")
    if not sep or not name or not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"expected NAME=N with N >= 1, got {text!r}")
    return normalize_model(name), int(number)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models", default=None, metavar="NAME[,NAME...]",
        help="the models that are there; others answer 404 (default: any name)")
    parser.add_argument(
        "--capabilities", type=_named_list_arg, action="append", default=[],
        metavar="NAME=CAP,...", help="a model's capabilities (default: completion,tools)")
    parser.add_argument(
        "--context-length", type=_named_int_arg, action="append", default=[],
        metavar="NAME=N", help=f"a model's trained window (default: {DEFAULT_CONTEXT_LENGTH})")
    parser.add_argument("--parallel", type=_positive_int_arg, default=None,
                        help="requests in progress at once per model; the rest queue")
    parser.add_argument("--load-ms", type=_non_negative_float_arg, default=0.0,
                        help="extra time of the first call to each model (loading it)")
    parser.add_argument("--show-without-capabilities", action="store_true",
                        help="leave capabilities out of /api/show, as older Ollama releases do")


def catalogue_from_args(args: argparse.Namespace) -> ModelCatalogue:
    served = None
    if args.models is not None:
        served = {normalize_model(n.strip()) for n in args.models.split(",") if n.strip()}
    return ModelCatalogue(served=served, capabilities=dict(args.capabilities),
                          context_length=dict(args.context_length),
                          parallel=args.parallel, load_ms=args.load_ms,
                          show_capabilities=not args.show_without_capabilities)


def _model_latency_arg(text: str) -> tuple[str, float]:
    name, sep, millis = text.partition("=")
    try:
        value = float(millis)
    except ValueError:
        value = -1.0
    if not sep or not name or value < 0:
        raise argparse.ArgumentTypeError(f"expected NAME=MS with MS >= 0, got {text!r}")
    return name, value


def _positive_float_arg(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _non_negative_float_arg(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _positive_int_arg(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.ollama_stub",
        description="Deterministic Ollama-compatible stand-in.",
    )
    parser.add_argument("--port", type=int, default=11435, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--chars-per-token", type=_positive_float_arg, default=4.0)
    parser.add_argument("--ms-per-token", type=_non_negative_float_arg, default=0.0)
    parser.add_argument(
        "--model-latency", type=_model_latency_arg, action="append", default=[],
        metavar="NAME=MS", help="fixed extra latency per request for a model (repeatable)",
    )  # fmt: skip
    parser.add_argument("--quirk", choices=QUIRKS, action="append", default=[])
    parser.add_argument("--default-num-ctx", type=_positive_int_arg, default=2048)
    parser.add_argument("--log-level", default="warning", help="uvicorn log level")
    add_model_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> StubConfig:
    return StubConfig(
        host=args.host,
        port=args.port,
        chars_per_token=args.chars_per_token,
        ms_per_token=args.ms_per_token,
        model_latency=dict(args.model_latency),
        quirks=set(args.quirk),
        default_num_ctx=args.default_num_ctx,
        models=catalogue_from_args(args),
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    sock = bind_socket(config.host, config.port)
    config.port = sock.getsockname()[1]
    app = build_app(config)
    server = StubServer(
        uvicorn.Config(
            app,
            log_level=args.log_level,
            access_log=False,
            # Backstop for slow streams still running at shutdown.
            timeout_graceful_shutdown=2,
        ),
        app.state.stub,
    )
    shown_host = f"[{config.host}]" if ":" in config.host else config.host
    print(f"ollama stand-in listening on http://{shown_host}:{config.port}", flush=True)
    server.run(sockets=[sock])
    return 0
