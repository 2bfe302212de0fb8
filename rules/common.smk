import ast
import sys

sys.path.insert(0, workflow.basedir)  # the package sits beside the Snakefile

from talkmethods import config as tm_config
from talkmethods import recipe as tm_recipe

# Check the whole config before any job runs: one line naming the key, no traceback.
try:
    tm_config.validate_config(config)
except tm_config.ConfigError as err:
    sys.stderr.write(f"error: {err}\n")
    sys.exit(1)


# Cheap bookkeeping rules run where Snakemake runs, not as cluster jobs.
localrules:
    train_curve,
    aggregate,
    card,


ARMS = config["arms"]
SEEDS = config["seeds"]
# train.cohort: the arms whose seeds train as one job (rule train_cohort); the rest a job a seed (rule train)
COHORT_ARMS = tm_config.cohort_arms(config)
LONE_ARMS = [a for a in ARMS if a not in COHORT_ARMS]
EVAL_KINDS = list(tm_recipe.RUN_EVAL_KINDS)
CKPT = config["checkpoint_dir"]


wildcard_constraints:
    arm="|".join(ARMS),
    seed=r"\d+",
    kind="|".join(EVAL_KINDS),


# The base model every arm and eval starts from: the warm start's output when the config has one.
BASE_MODEL = (
    [f"results/{tm_config.WARMSTART_MODEL}"] if config["model"]["warmstart"] else []
)


# ---- code inputs: the files a stage's script imports, directly or not --------------------------
# A rule lists them as inputs, so editing any module a stage runs reruns that stage and what follows
# (and nothing else). Found by reading the imports (ast), not by importing: planning stays fast.
SCRIPTS = os.path.join(workflow.basedir, "workflow_scripts")


def _module_file(name):
    """The file of module ``name`` when it is ours: talkmethods.* (module or package) or a script helper."""
    parts = name.split(".")
    root = workflow.basedir if parts[0] == "talkmethods" else SCRIPTS
    base = os.path.join(root, *parts)
    for path in (f"{base}.py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def _imports(path):
    """Every module name an import statement of ``path`` names, at any depth (lazy imports too)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def code_inputs(*entries):
    """The files the scripts ``entries`` (under workflow_scripts/, or paths) import, closed over imports.

    Importing ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` too, so those count.
    """
    todo = [e if os.path.isabs(e) else os.path.join(SCRIPTS, e) for e in entries]
    seen = set()
    while todo:
        path = os.path.normpath(todo.pop())
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path):
            parts = name.split(".")
            todo += filter(
                None,
                (_module_file(".".join(parts[:i])) for i in range(1, len(parts) + 1)),
            )
    return sorted(seen)
