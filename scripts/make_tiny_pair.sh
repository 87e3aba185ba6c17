#!/usr/bin/env bash
# Rebuilds the tiny model pair shipped in dspark_rt/pretrained/: a Qwen3 target, three DSpark
# drafters (vanilla Markov, gated Markov and RNN sequential heads, each with a confidence head,
# gamma 7) and a DFlash drafter with the same backbone, plus each DSpark confidence head's
# calibration (a survival table per position), and the target's held-out loss. About an hour on
# 2 CPU cores (THREADS=2).
#
# Data: the Python standard library of the interpreter that runs this (*.py files; test suites,
# site-packages, encodings, pydoc_data and files over 200 kB skipped; all of the rest, 9 MB of
# CPython 3.11's, is training text; every 25th file is held out for the calibration prompts and
# the held-out loss). Nothing is downloaded, and the evaluation prompt sets are not used. Seeds
# are fixed; CPU thread scheduling can still change the last bits of the weights from one run to
# the next.
#
#   scripts/make_tiny_pair.sh              # work files in out/tiny_pair, result in dspark_rt/pretrained
#   RESUME=1 scripts/make_tiny_pair.sh     # continue interrupted training stages, keep finished
#                                          # tokenizer / regen / prompt files
#   WORK=/tmp/pair DEST=/tmp/pair/ship THREADS=4 scripts/make_tiny_pair.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
W=${WORK:-out/tiny_pair}
DEST=${DEST:-dspark_rt/pretrained}
# one torch thread by default: on 2 busy shared cores it ran 2x faster than two (no intra-op
# barriers to miss); on 2 quiet cores THREADS=2 is faster (1.1 s per target step)
T=(--threads "${THREADS:-1}")
R=()
[ -n "${RESUME:-}" ] && R=(--resume)
mkdir -p "$W"
have() { [ -n "${RESUME:-}" ] && [ -e "$1" ]; }
stage() {  # stage NAME ARGS...: runs `python -m dspark_rt.train ARGS...`, logs its wall time
    local name=$1 t0=$SECONDS
    shift
    echo "== $name: python -m dspark_rt.train $*"
    $PY -m dspark_rt.train "$@" | tee "$W/$name.json"
    echo "$name $((SECONDS - t0)) s" | tee -a "$W/timings.txt"
}

have "$W/tokenizer/tokenizer.json" ||
    stage tokenizer tokenizer --out "$W/tokenizer" --vocab 2048 --max-bytes 10000000 --seed 0
# 4 layers, d 256, 4 heads / 2 KV heads, head_dim 64, FFN 768, tied embeddings, context 512:
# 1200 steps x 8 x 512 tokens = 4.9 M tokens (about 1.8 epochs of the whole library, 9 MB)
stage target target --tokenizer "$W/tokenizer" --out "$W/target" --steps 1200 --batch 8 --seq 512 \
    --max-bytes 10000000 \
    --lr 2e-3 --warmup 30 --save-every 50 --seed 0 --compile "${T[@]}" "${R[@]}"
# its greedy text falls into loops on some demo prompts (a model this small): 150 steps more of
# sequence-level unlikelihood on its own greedy continuations (tokens of repeated 4-grams pushed
# down, next to the usual cross-entropy) train them away; that model is the shipped target
stage target_ul target --tokenizer "$W/tokenizer" --init "$W/target" --out "$W/target_ul" \
    --seq-unlikelihood 1.0 --steps 150 --batch 8 --seq 512 --max-bytes 10000000 \
    --lr 5e-4 --warmup 10 --save-every 25 --seed 1 "${T[@]}" "${R[@]}"
# the loss on the held-out files (never trained on), before and after: nats per token, bits per byte
stage heldout_pretrained heldout --target "$W/target" "${T[@]}"
stage heldout heldout --target "$W/target_ul" "${T[@]}"
# the target's own continuations of 768 corpus windows (half greedy, half sampled at T = 0.8)
have "$W/regen.pt" ||
    stage regen regen --target "$W/target_ul" --out "$W/regen.pt" --num 768 --batch 128 --max-bytes 10000000 \
        --prompt-len 128 --new-tokens 128 --temperature 0.8 --seed 0 "${T[@]}"
# one drafter layer over target layers 0, 1, 2; 32 anchors per sequence; same recipe for both
D=(--target "$W/target_ul" --data "$W/regen.pt" --gamma 7 --layers 1 --anchors 32 --steps 900
   --batch 8 --lr 3e-3 --warmup 20 --save-every 50 --seed 0 "${T[@]}" "${R[@]}")
stage dspark drafter --out "$W/dspark" --head vanilla --rank 128 "${D[@]}"
stage dflash drafter --out "$W/dflash" --head none "${D[@]}"
# the other two sequential heads (DESIGN section 2): gated Markov (g = sigmoid(gate_proj [h_k; e]),
# bias = W2 (g * e)) and RNN (joint_proj [s; e; h_k] -> gate, candidate, output thirds), each
# trained alone (with its confidence head) on the frozen backbone of the DFlash drafter above,
# same data, steps, schedule and seed
for h in gated rnn; do
    stage "dspark_$h" drafter --out "$W/dspark_$h" --head "$h" --rank 128 \
        --upgrade-dflash "$W/dflash" "${D[@]}"
done
# calibration of the DSpark confidence heads (a survival table per position) on held-out stdlib
# windows (not the eval sets)
have "$W/calib_prompts.jsonl" ||
    stage prompts prompts --out "$W/calib_prompts.jsonl" --num 48 --chars 600 --seed 0
for d in dspark dspark_gated dspark_rnn; do
    t0=$SECONDS
    $PY -m dspark_rt calibrate --target "$W/target_ul" --drafter "$W/$d" \
        --prompts "$W/calib_prompts.jsonl" --max-tokens 64 --out "$W/$d/dspark_calibration.json"
    echo "calibrate $d $((SECONDS - t0)) s" | tee -a "$W/timings.txt"
done

mkdir -p "$DEST/target" "$DEST/dspark" "$DEST/dspark_gated" "$DEST/dspark_rnn" "$DEST/dflash"
cp "$W/target_ul/"{config.json,model.safetensors,tokenizer.json,tokenizer_config.json} \
    "$W/target/chat_template.jinja" "$DEST/target/"
for d in dspark dspark_gated dspark_rnn; do
    cp "$W/$d/"{config.json,model.safetensors,dspark_calibration.json} "$DEST/$d/"
done
cp "$W/dflash/"{config.json,model.safetensors} "$DEST/dflash/"
chmod 644 "$DEST"/*/*
du -sh "$DEST"
cat "$W/timings.txt"
