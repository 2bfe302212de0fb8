# Talk Methods: which RL method best teaches two copies of a model to talk their way to a right answer?
# data split -> per-(arm, seed) training -> held-out eval and cross-play -> aggregate -> card


configfile: os.path.join(workflow.basedir, "config.yaml")


include: "rules/common.smk"
include: "rules/data.smk"
include: "rules/warmstart.smk"


# train.cohort: an arm's seeds as one job (their chats decoded as one batch) or a job a seed, arm by arm


if LONE_ARMS:

    include: "rules/train.smk"


if COHORT_ARMS:

    include: "rules/train_cohort.smk"


include: "rules/arms.smk"
include: "rules/eval.smk"
include: "rules/card.smk"
include: "rules/bench.smk"


rule all:
    input:
        "results/card.md",
        "results/card.png",
