#!/usr/bin/env bash
# Builds llama.cpp's llama-server, the peer that benchmarks/peer_bench.py runs beside treadle,
# from the llama.cpp source vendored in the llama-cpp-python sdist (PyPI; nothing else is
# fetched), once per ISA level:
#   $PEERS/llama-server-native  GGML_NATIVE=ON (what a user of this CPU would build)
#   $PEERS/llama-server-avx2    AVX2 + FMA + F16C, no AVX-512: the peer of TREADLE_CPU_ISA=avx2
#   $PEERS/llama-perplexity-native  the perplexity (and top-token) peer of benchmarks/quality.py
# Usage: build_llama_server.sh PYTHON PEERS_DIR SDIST_SPEC
set -euo pipefail
python=$1 peers=$2 spec=$3
mkdir -p "$peers"
peers=$(cd "$peers" && pwd)
if [ ! -d "$peers/src" ]; then
    echo "== downloading the $spec sdist (llama.cpp's source is vendored in it)"
    rm -rf "$peers/dl" && mkdir -p "$peers/dl"
    "$python" -m pip download --no-binary :all: --no-deps -d "$peers/dl" "$spec"
    mkdir -p "$peers/src.tmp"
    tar -xzf "$peers"/dl/*.tar.gz -C "$peers/src.tmp" --strip-components=1
    mv "$peers/src.tmp" "$peers/src"
fi
llama="$peers/src/vendor/llama.cpp"
common=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_OPENMP=ON -DLLAMA_BUILD_TESTS=OFF
        -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF)
build() {  # name, cmake flags...
    local name=$1; shift
    if [ -x "$peers/llama-server-$name" ]; then
        echo "== $peers/llama-server-$name is built"; return
    fi
    echo "== building llama-server-$name ($*)"
    cmake -S "$llama" -B "$peers/build-$name" "${common[@]}" "$@" >/dev/null
    cmake --build "$peers/build-$name" --target llama-server -j "$(nproc)" 2>&1 \
        | grep -E '^\[ *[0-9]+%\] (Built|Linking)' || true
    cp "$peers/build-$name/bin/llama-server" "$peers/llama-server-$name"
}
build native -DGGML_NATIVE=ON
if [ ! -x "$peers/llama-perplexity-native" ]; then
    echo "== building llama-perplexity-native"
    cmake --build "$peers/build-native" --target llama-perplexity -j "$(nproc)" 2>&1 \
        | grep -E '^\[ *[0-9]+%\] (Built|Linking)' || true
    cp "$peers/build-native/bin/llama-perplexity" "$peers/llama-perplexity-native"
fi
build avx2 -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF \
    -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF
