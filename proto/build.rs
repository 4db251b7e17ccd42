use std::{env, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A fresh machine needs no system protoc: use the vendored one unless PROTOC is set.
    if env::var_os("PROTOC").is_none() {
        // Build scripts are single-threaded, so changing our own environment is sound.
        unsafe { env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    // Each side generates only its own stubs: the client crate never compiles
    // the server trait, nor the server the client stub.
    let server = env::var_os("CARGO_FEATURE_SERVER").is_some();
    let client = env::var_os("CARGO_FEATURE_CLIENT").is_some();
    let out = PathBuf::from(env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .build_server(server)
        .build_client(client)
        // Batch results carry google.rpc.Status: use tonic-types' generated type,
        // the one tonic's richer error model already decodes.
        .extern_path(".google.rpc", "::tonic_types::pb")
        // The encoded descriptors, served by the server's reflection.
        .file_descriptor_set_path(out.join("idempotency_descriptor.bin"))
        .compile_protos(&["idempotency/v1/idempotency.proto"], &["."])?;
    println!("cargo:rerun-if-changed=idempotency");
    println!("cargo:rerun-if-changed=google");
    Ok(())
}
