fn main() {
    // sqlx::migrate! embeds the SQL at compile time. (The generated protobuf
    // code comes from the idempotency-proto crate.)
    println!("cargo:rerun-if-changed=../migrations");
}
