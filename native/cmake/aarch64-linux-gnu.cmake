# Cross-build native/ for 64-bit ARM Linux with Debian's cross toolchain (native/build.sh --target aarch64).
#   apt-get install g++-aarch64-linux-gnu qemu-user libpcre2-dev:arm64   (after dpkg --add-architecture arm64)
# ExecuTorch comes from the aarch64 wheel that build.sh unpacks and passes as CMAKE_PREFIX_PATH.
set(CMAKE_SYSTEM_NAME Linux)
# what CMakeLists.txt reads to build the kernels' ARM paths, not the x86 ones (nothing of the build host's CPU)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)

# Debian multiarch: the arm64 libraries (PCRE2) are in /usr/lib/aarch64-linux-gnu, headers in /usr/include
# (shared with the host: nlohmann-json is header-only). No sysroot re-rooting: find_library then looks in
# lib/aarch64-linux-gnu, never the host's lib/x86_64-linux-gnu.
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
list(APPEND CMAKE_IGNORE_PATH /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu)

# try_run and `ctest` run the target's binaries under user-mode QEMU, as `python -m pipeline native run --target
# aarch64` does (pipeline/native.py qemu_command says why each flag)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /usr/aarch64-linux-gnu -cpu neoverse-n1 -E LD_LIBRARY_PATH=/lib)
