//! Generates the example payments service of `client/examples/grpc_payments`
//! (code and descriptor set) into OUT_DIR. The client crate keeps committed
//! copies, so that it needs no build script; a test checks they match.

use std::{env, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A fresh machine needs no system protoc: use the vendored one unless PROTOC is set.
    if env::var_os("PROTOC").is_none() {
        // Build scripts are single-threaded, so changing our own environment is sound.
        unsafe { env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    let out = PathBuf::from(env::var("OUT_DIR")?);
    let dir = "../client/examples/grpc_payments";
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("payments_descriptor.bin"))
        .compile_protos(&[format!("{dir}/payments.proto")], &[dir.to_owned()])?;
    println!("cargo:rerun-if-changed={dir}/payments.proto");
    Ok(())
}
