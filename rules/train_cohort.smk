# An arm's seeds as one job (the arms train.cohort names): their chats decode as one batch, each seed's
# outputs as a run's. A target of one seed (results/raft/seed17/eval.json) then trains all of the arm's seeds.
rule train_cohort:
    input:
        problems="results/data/train.jsonl",
        base=BASE_MODEL,
        src=code_inputs("train_cohort.py"),
    output:
        adapters=[directory(f"results/{{arm}}/seed{s}/adapter") for s in SEEDS],
        logs=[f"results/{{arm}}/seed{s}/train_log.jsonl" for s in SEEDS],
    log:
        "results/logs/train/{arm}_cohort.log",
    benchmark:
        "results/benchmarks/train/{arm}_cohort.tsv"
    wildcard_constraints:
        arm="|".join(COHORT_ARMS),
    conda:
        "../envs/talkmethods.yaml"
    threads: 2
    resources:
        gpu=1,
    params:
        train=lambda wc: [tm_config.train_params(config, wc.arm, s) for s in SEEDS],
        work_dirs=lambda wc: [f"{CKPT}/{wc.arm}/seed{s}" for s in SEEDS],
    script:
        "../workflow_scripts/train_cohort.py"
