//! sparsekit GPU kernels: `#![no_std]` Rust generic over a SIMT trait, compiled to PTX by
//! the root package's build script and run on the host by an emulator.
#![no_std]
