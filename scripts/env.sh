# Sourced by the build scripts: finds nvcc and sets up ccache.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/sparsekv-ccache}"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-2G}"
BUILD_DIR="${BUILD_DIR:-build}"
JOBS="${JOBS:-$(nproc)}"
configure_and_build() {
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
  cmake --build "$BUILD_DIR" -j "$JOBS"
}
