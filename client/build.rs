use std::env;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A fresh machine needs no system protoc: use the vendored one unless PROTOC is set.
    if env::var_os("PROTOC").is_none() {
        // Build scripts are single-threaded, so changing our own environment is sound.
        unsafe { env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    tonic_prost_build::configure()
        .build_server(false)
        // Batch results carry google.rpc.Status: use tonic-types' generated type,
        // the one tonic's richer error model already decodes.
        .extern_path(".google.rpc", "::tonic_types::pb")
        .compile_protos(
            &["../proto/idempotency/v1/idempotency.proto"],
            &["../proto"],
        )?;
    println!("cargo:rerun-if-changed=../proto");
    Ok(())
}
