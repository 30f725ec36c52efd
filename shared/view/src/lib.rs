//! How a session looks to a person. [`graph`] draws its DAG (for `troupe graph` and the
//! coordinator's web view).

pub mod graph;
