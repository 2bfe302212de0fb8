rule train:
    input:
        problems="results/data/train.jsonl",
        base=BASE_MODEL,
        src=code_inputs("train.py"),
    output:
        adapter=directory("results/{arm}/seed{seed}/adapter"),
        log="results/{arm}/seed{seed}/train_log.jsonl",
    log:
        "results/logs/train/{arm}_seed{seed}.log",
    benchmark:
        "results/benchmarks/train/{arm}_seed{seed}.tsv"
    wildcard_constraints:
        arm="|".join(LONE_ARMS),
    conda:
        "../envs/talkmethods.yaml"
    threads: 2
    resources:
        gpu=1,
    params:
        train=lambda wc: tm_config.train_params(config, wc.arm, wc.seed),
        work_dir=lambda wc: f"{CKPT}/{wc.arm}/seed{wc.seed}",
    script:
        "../workflow_scripts/train.py"
