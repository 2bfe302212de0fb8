import sys

sys.path.insert(0, workflow.basedir)  # the package sits beside the Snakefile

from talkmethods import config as tm_config

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
EVAL_KINDS = ["eval", "crossplay", "crossplay_bA"]
CKPT = config["checkpoint_dir"]


wildcard_constraints:
    arm="|".join(ARMS),
    seed=r"\d+",
    kind="|".join(EVAL_KINDS),


# The base model every arm and eval starts from: the warm start's output when the config has one.
BASE_MODEL = (
    [f"results/{tm_config.WARMSTART_MODEL}"] if config["model"].get("warmstart") else []
)


def package_src(*modules):
    """The package modules a stage runs, as inputs: editing one reruns that stage and what follows."""
    return [os.path.join(workflow.basedir, "talkmethods", f"{m}.py") for m in modules]
