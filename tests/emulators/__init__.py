"""CPU emulators of the GPU kernels, at the level of their index math (imported by the tests)."""
