//! Integration tests: the real coordinator (`run()` on a port-0 listener), real SQLite in a
//! temporary directory, real git repositories, spoken to over gRPC.

mod bases;
mod bus;
mod convergence;
mod fairness;
mod pause;
mod plans;
mod processes;
mod restart;
mod rounds;
mod routing;
mod scale;
mod scheduling;
mod sessions;
mod support;
mod upload;
mod watch;
