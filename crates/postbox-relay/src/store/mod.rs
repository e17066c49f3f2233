//! The benchmark's statements, until they move next to the benchmark. Every
//! other statement the relay runs is in the `postbox-store` crate.

