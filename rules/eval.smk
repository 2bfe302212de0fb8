rule eval_run:
    input:
        problems="results/data/heldout.jsonl",
        base=BASE_MODEL,
        adapter="results/{arm}/seed{seed}/adapter",
        src=package_src(
            "evaluate",
            "rollout",
            "engine",
            "fastdecode",
            "dialogue",
            "grading",
            "models",
            "stages",
        ),
    output:
        "results/{arm}/seed{seed}/{kind}.json",
    log:
        "results/logs/eval/{arm}_seed{seed}_{kind}.log",
    benchmark:
        "results/benchmarks/eval/{arm}_seed{seed}_{kind}.tsv"
    conda:
        "../envs/talkmethods.yaml"
    threads: 2
    resources:
        gpu=1,
    params:
        eval=tm_config.eval_params(config),
    script:
        "../workflow_scripts/evaluate.py"


rule eval_base:
    input:
        problems="results/data/heldout.jsonl",
        base=BASE_MODEL,
        src=package_src(
            "evaluate",
            "rollout",
            "engine",
            "fastdecode",
            "dialogue",
            "grading",
            "models",
            "stages",
        ),
    output:
        "results/base/eval.json",
    log:
        "results/logs/eval/base.log",
    benchmark:
        "results/benchmarks/eval/base.tsv"
    conda:
        "../envs/talkmethods.yaml"
    threads: 2
    resources:
        gpu=1,
    params:
        eval=tm_config.eval_params(config),
    script:
        "../workflow_scripts/evaluate.py"
