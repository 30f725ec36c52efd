//! Integration tests of the `troupe` crate: the embedded services driven through gRPC.

mod ccw;
mod doctor;
