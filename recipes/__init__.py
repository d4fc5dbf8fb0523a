"""The recipes: pretraining (docs/recipe.md) and a VLA policy (``recipes.vla``, docs/embodied.md),
applications of dmuon_fsdp with needs of their own,
the ``recipes`` extra (``pip install -e '.[recipes]'``); without them it stops with one line
that says so."""

import importlib.util

_MISSING = [name for name in ("einops", "tqdm") if importlib.util.find_spec(name) is None]
if _MISSING:
    raise SystemExit(
        f"error: the recipe needs {' and '.join(_MISSING)} (its extra): pip install -e '.[recipes]', "
        "or bash scripts/setup_env.sh recipes"
    )
