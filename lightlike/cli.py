"""The ``lightlike`` command line.

    lightlike export CHECKPOINT_DIR OUT_DIR [--no-verify-hashes]
    lightlike config [--config run.toml|run.json] [--KEY VALUE ...]   print the resolved config
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightlike.errors import LightlikeError


def _cmd_export(args: argparse.Namespace) -> int:
    from lightlike.checkpoint.export import export_weights

    path = export_weights(args.checkpoint_dir, args.out_dir, hashes=not args.no_verify_hashes)
    print(f"wrote {path}")
    return 0


def _cmd_config(args: argparse.Namespace, overrides: list[str]) -> int:
    from lightlike.config import FitConfig, check_keys

    base: dict = {}
    if args.config:
        cfg_text = FitConfig.from_toml(args.config) if args.config.endswith(".toml") else FitConfig.from_json(args.config)
        base = cfg_text.to_dict()
    pairs = dict(_parse_overrides(overrides))
    check_keys(pairs)
    base.update(pairs)
    base.setdefault("max_steps", None)
    if base.get("max_steps") is None and base.get("max_epochs") is None:
        base["max_epochs"] = 1  # so the printout validates; a real fit still needs one
    print(FitConfig.from_dict(base).to_toml(), end="")
    return 0


def _parse_overrides(items: list[str]) -> list[tuple[str, object]]:
    import json

    out = []
    it = iter(items)
    for flag in it:
        if not flag.startswith("--"):
            raise LightlikeError(f"expected --KEY VALUE, got {flag!r}")
        key = flag[2:].replace("-", "_")
        if "=" in key:
            key, raw = key.split("=", 1)
        else:
            raw = next(it, None)
            if raw is None:
                raise LightlikeError(f"--{key} needs a value")
        try:
            value: object = json.loads(raw)
        except ValueError:
            value = raw
        out.append((key, value))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightlike", description="lightlike command line")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("export", help="write a plain model.safetensors (+ config) from a checkpoint")
    p.add_argument("checkpoint_dir")
    p.add_argument("out_dir")
    p.add_argument("--no-verify-hashes", action="store_true", help="check sizes only (fast, for huge models)")
    p = sub.add_parser("config", help="print the full resolved config with defaults")
    p.add_argument("--config", help="a TOML or JSON config file")
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "export":
            if rest:
                parser.error(f"unrecognised arguments: {' '.join(rest)}")
            return _cmd_export(args)
        return _cmd_config(args, rest)
    except LightlikeError as e:
        print(f"lightlike: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
