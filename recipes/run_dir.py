"""The run directory: one run's config.json, metrics.jsonl, summary.json and checkpoints.

``saved_config`` reads the config.json of the run --resume names: its settings stand for the
flags not given again. With the run dir locked, ``find_resumed`` finds the checkpoint and
``plan_start`` decides, reading only, where a run starts: fresh, or from which checkpoint; it
refuses (UsageError) to mix two runs in one directory or to resume a run of another model,
data or optimizer. ``begin`` then carries the decision out on rank 0: deletes an earlier run on
--overwrite, writes config.json and cuts metrics.jsonl back to the checkpoint's step. Every
file it rewrites is replaced whole (``replace_file``): a kill at any moment leaves the old file
or the new one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from recipes import checkpoint
from recipes.options import PER_LAUNCH, UsageError, lr_factor, run_settings

RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "checkpoints", "tensorboard")


@dataclass
class Resumed:
    """What --resume names, read before anything else (the flags not given again come from it)."""

    checkpoint: Path | None  # the complete checkpoint to continue from, or None
    source_dir: Path | None  # the run directory it belongs to (None: a checkpoint outside one)
    continues_run: bool  # --run-dir's own run goes on
    config: dict | None  # the config.json of source_dir (or of --run-dir with --resume auto)


@dataclass
class RunStart:
    run_dir: Path
    checkpoint: Path | None  # resume from it, or start fresh
    step: int  # steps already done
    continues_run: bool  # the run dir's own run goes on: its metrics are cut back to ``step``
    delete: list[Path]  # an earlier run's files (--overwrite), incomplete checkpoints past ``step``
    notes: list[str]  # printed by rank 0
    config: dict  # written to config.json


def make_config(args: argparse.Namespace, world_size: int, data: str, model: dict, **about: object) -> dict:
    """config.json: the run's identity, every flag, its data and model (``model`` holds the
    model's settings, ``vocab_size`` among them), and what else the recipe says ``about`` it."""
    return {
        "run_id": uuid.uuid4().hex[:12],
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": world_size,
        "args": run_settings(args),
        "data": data,
        **about,
        "model": model,
    }


def _differences(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """(differences that make a resume wrong, other changed settings), each 'what: old -> new'."""
    pairs = [
        ("preset", old["args"]["preset"], new["args"]["preset"]),
        ("data", old["data"], new["data"]),
        ("vocabulary", old["model"]["vocab_size"], new["model"]["vocab_size"]),
        ("optimizer", old["args"]["optimizer"], new["args"]["optimizer"]),
    ]
    if old["args"]["preset"] == new["args"]["preset"]:  # else the preset says it all
        pairs += [(k, old["model"].get(k), v) for k, v in new["model"].items() if k != "vocab_size"]
    wrong = [f"{what} {a} -> {b}" for what, a, b in pairs if a != b]
    changed = [
        f"--{k.replace('_', '-')} {old['args'].get(k)} -> {v}"
        for k, v in new["args"].items()
        if k not in PER_LAUNCH and k in old["args"] and old["args"][k] != v
    ]
    if old["world_size"] != new["world_size"]:
        changed.append(f"ranks {old['world_size']} -> {new['world_size']}")
    return wrong, changed


def _schedule_change(old: dict, new: dict, step: int) -> str | None:
    """What a changed schedule (length, warm-up, decay, peak) does to the next step's lr."""
    was, now = (
        args["lr"] * lr_factor(argparse.Namespace(**args))(step) for args in (old["args"], new["args"])
    )
    if was == now:
        return None
    return f"the lr of step {step + 1} is {now:.5g} ({was:.5g} on the run's schedule until now)"


def _resolve(target: Path) -> Path:
    """The checkpoint ``--resume target`` names: a step directory, or a run directory's newest
    complete one."""
    if not target.is_dir():
        raise UsageError(
            f"--resume {target}: {'not a directory' if target.exists() else 'no such directory'}"
        )
    if checkpoint.is_complete(target):
        if checkpoint.step_of(target) is None:
            raise UsageError(
                f"--resume {target}: a checkpoint directory must keep its name step_N (N: its step)"
            )
        return target
    if target.name.startswith("step_"):
        raise UsageError(f"--resume {target}: incomplete checkpoint (no .metadata: its save did not finish)")
    newest = checkpoint.latest(target)
    if newest is None:
        steps = checkpoint.all_steps(target)
        what = f"only incomplete ones: {', '.join(p.name for p in steps)}" if steps else "none"
        raise UsageError(f"--resume {target}: no complete checkpoint under {target / 'checkpoints'} ({what})")
    return newest


def _read_config(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UsageError(f"{path} is not valid JSON ({error})") from error


def find_resumed(args: argparse.Namespace) -> Resumed:
    """The checkpoint --resume names and its run's config.json; raises UsageError naming the
    flag and path. Reads, never writes."""
    run_dir = Path(args.run_dir)
    found = (
        checkpoint.latest(run_dir)
        if args.resume == "auto"
        else _resolve(Path(args.resume))
        if args.resume
        else None
    )
    source_dir = found.parent.parent if found is not None and found.parent.name == "checkpoints" else None
    continues_run = args.resume == "auto" or (
        source_dir is not None and source_dir.resolve() == run_dir.resolve()
    )
    config = _read_config((source_dir or run_dir) / "config.json") if source_dir or continues_run else None
    return Resumed(found, source_dir, continues_run, config)


def saved_config(args: argparse.Namespace) -> dict | None:
    """The config.json of the run --resume continues, if there is one: its settings stand for
    the flags not given again. Read before the run dir is locked, so it only looks (where the
    checkpoint is and whether it is complete is decided under the lock, by ``find_resumed``)."""
    if not args.resume:
        return None
    target = Path(args.run_dir) if args.resume == "auto" else Path(args.resume)
    if args.resume != "auto" and not target.exists():  # before the lock makes the run dir
        raise UsageError(f"--resume {target}: no such directory")
    if target.parent.name == "checkpoints" and checkpoint.step_of(target) is not None:
        target = target.parent.parent
    config = _read_config(target / "config.json") if target.is_dir() else None
    if config is not None and not isinstance(config.get("args"), dict):
        raise UsageError(f"the config.json of {target} lacks 'args': not one this recipe wrote")
    return config


def check_run_dir(args: argparse.Namespace) -> None:
    """--run-dir can be made and written: no file on its path, its nearest existing folder writable."""
    run_dir = Path(args.run_dir)
    existing = next(p for p in (run_dir.absolute(), *run_dir.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"--run-dir {run_dir}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK):
        raise UsageError(f"--run-dir {run_dir}: {existing} is not writable")


def plan_start(args: argparse.Namespace, config: dict, resumed: Resumed) -> RunStart:
    """Where this run starts; raises UsageError naming the flag and path. Reads, never writes;
    called with the run dir locked, so every rank reads the same."""
    run_dir = Path(args.run_dir)
    used = [name for name in RUN_FILES if (run_dir / name).exists()]
    notes: list[str] = []
    delete: list[Path] = []
    found, source_dir, continues_run = resumed.checkpoint, resumed.source_dir, resumed.continues_run
    if source_dir is not None:
        assert found is not None  # (source_dir is the run directory found belongs to)
        last = checkpoint.step_number(found)
        newer = [p for p in checkpoint.all_steps(source_dir) if checkpoint.step_number(p) > last]
        if continues_run and any(map(checkpoint.is_complete, newer)):
            raise UsageError(
                f"--resume {args.resume}: {run_dir} has newer complete checkpoints "
                f"({', '.join(p.name for p in newer if checkpoint.is_complete(p))}) that resuming from "
                f"{found.name} would abandon; delete them first, or resume into another --run-dir"
            )
        for path in newer:  # incomplete: a save cut short
            notes.append(
                f"{'removing' if continues_run else 'skipping'} incomplete checkpoint {path} (no .metadata)"
            )
        delete += newer if continues_run else []
    elif continues_run:  # --resume auto with no complete checkpoint: a fresh start in this run dir
        if (run_dir / "summary.json").exists():
            raise UsageError(
                f"--resume auto: {run_dir} holds a finished run and no complete checkpoint to continue "
                "from; start a new --run-dir, or replace it with --overwrite (without --resume)"
            )
        delete += checkpoint.all_steps(run_dir)
        notes += [f"removing incomplete checkpoint {p} (no .metadata)" for p in delete]
        if (run_dir / "metrics.jsonl").exists():
            notes.append(f"no complete checkpoint in {run_dir}: starting it again from step 0")
    if used and not continues_run and not args.overwrite:
        raise UsageError(
            f"--run-dir {run_dir} already holds a run ({', '.join(used)}): continue it with "
            f"--resume {run_dir}, or pass --overwrite to delete it"
        )
    if args.overwrite and continues_run and found is not None:
        raise UsageError(f"--overwrite would delete the checkpoint --resume names ({found})")
    if found is not None and source_dir is None:
        notes.append(f"cannot check the settings of {found}: it is not in a run directory's checkpoints/")
    elif found is not None and resumed.config is None:
        notes.append(f"cannot check the settings of {found}: no config.json in {source_dir}")
    step = checkpoint.step_number(found) if found is not None else 0
    earlier = resumed.config
    if earlier is not None:
        try:
            wrong, changed = _differences(earlier, config)
            schedule = _schedule_change(earlier, config, step) if changed else None
        except KeyError as key:
            raise UsageError(
                f"the config.json of {source_dir or run_dir} lacks {key}: not one this recipe wrote"
            ) from None
        if wrong:
            where = found if found is not None else run_dir
            raise UsageError(
                f"--resume {args.resume}: {where} differs from this run in {'; '.join(wrong)} "
                "(earlier -> now); start a new --run-dir for other settings"
            )
        if changed:
            notes.append(
                "resuming with changed settings: " + ", ".join(changed + ([schedule] if schedule else []))
            )
        if continues_run:
            config = {**config, "run_id": earlier["run_id"], "created": earlier["created"]}
    if step >= args.steps:
        raise UsageError(
            f"--steps {args.steps}: {found} is already at step {step} (the run is done); pass a larger "
            "--steps to train it further"
        )
    delete += [run_dir / name for name in used] if args.overwrite else []
    return RunStart(run_dir, found, step, continues_run, delete, notes, config)


def replace_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole: into a temporary file beside it, then renamed over it."""
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def begin(start: RunStart) -> float:
    """Carry out ``start`` (rank 0 only); returns the training seconds the kept metrics cover."""
    for path in start.delete:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    start.run_dir.mkdir(parents=True, exist_ok=True)
    (start.run_dir / "summary.json").unlink(missing_ok=True)  # describes an earlier end
    metrics = start.run_dir / "metrics.jsonl"
    kept: list[str] = []
    if start.continues_run and metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash
                continue
            if record["step"] <= start.step:
                kept.append(line)
    replace_file(metrics, "".join(line + "\n" for line in kept))
    replace_file(start.run_dir / "config.json", json.dumps(start.config, indent=2) + "\n")
    return json.loads(kept[-1]).get("time_s", 0.0) if kept else 0.0
