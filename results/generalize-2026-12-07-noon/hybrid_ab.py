"""A/B: migrate vs hybrid (dw scorer) vs hybrid (magnitude scorer: no per-step observation),
seed 24157's case, interleaved rounds; median step of iterations 17-32."""
import json, os, statistics, subprocess, sys, tempfile
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from gloo_ranks import pretrain_command
MODEL = ("--num-layers 2 --hidden-size 640 --num-attention-heads 10 --ffn-hidden-size 2560 --seq-length 128 "
         "--max-position-embeddings 128 --micro-batch-size 2 --lr 1e-4 --mock-data --vocab-size 255 "
         "--hidden-dropout 0 --attention-dropout 0 --group-query-attention --num-query-groups 2 "
         "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
         "--tensor-model-parallel-size 2 --global-batch-size 2 --train-iters 32 --eval-iters 0 "
         "--log-interval 100 --het-tp-interval 4 --het-tp-emulate persistent:rank=0,factor=3.7,start=10").split()
CONFIGS = {
    "migrate": ["--het-tp-policy", "migrate"],
    "hybrid-dw": ["--het-tp-policy", "hybrid"],
    "hybrid-magnitude": ["--het-tp-policy", "hybrid", "--het-tp-priority", "magnitude"],
}
out = {k: [] for k in CONFIGS}
tmp = tempfile.mkdtemp()
for rnd in range(int(sys.argv[1])):
    for name, flags in CONFIGS.items():
        m = os.path.join(tmp, f"{name}.{rnd}.jsonl")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        r = subprocess.run(pretrain_command(MODEL + flags + ["--metrics-file", m], port=29600 + rnd),
                           env=env, capture_output=True, text=True, cwd=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
        if r.returncode:
            print(name, "failed", [l for l in (r.stdout + r.stderr).splitlines() if "rror" in l][:5]); sys.exit(1)
        recs = [json.loads(l) for l in open(m)]
        steps = {x["iteration"]: x["elapsed_ms"] for x in recs if x.get("kind") == "train"}
        sampled = [steps[i] for i in (24, 32)]
        out[name].append((statistics.median(steps[i] for i in range(17, 33)), statistics.median(steps[i] for i in range(17, 33) if i % 8), sampled))
        print(name, rnd, [round(x, 1) if not isinstance(x, list) else [round(y) for y in x] for x in out[name][-1]], flush=True)
for name, rows in out.items():
    print(name, "median step 17-32: %.1f ms; without iterations 24, 32: %.1f ms" % (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)))
