//! Which scopes may call each RPC. Every RPC of `proto/troupe/v1` is listed (a test checks
//! it against the descriptor set); anything not listed needs `admin`.

use super::{Reflection, Scope, Scopes};

/// What a request needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Anyone, without credentials.
    Open,
    /// A caller holding one of these scopes (or `admin`).
    Needs(Scopes),
}

const WORKER: &[Scope] = &[Scope::Worker];
const CLIENT: &[Scope] = &[Scope::Client];
const BOTH: &[Scope] = &[Scope::Worker, Scope::Client];

/// `(service, method, scopes beyond admin)` for every business RPC.
pub const RPCS: &[(&str, &str, &[Scope])] = &[
    ("troupe.v1.Coordinator", "CreateSession", CLIENT),
    ("troupe.v1.Coordinator", "UploadPlan", CLIENT),
    ("troupe.v1.Coordinator", "GetSession", CLIENT),
    ("troupe.v1.Coordinator", "ListTasks", CLIENT),
    ("troupe.v1.Coordinator", "ListSessions", CLIENT),
    ("troupe.v1.Coordinator", "CancelSession", CLIENT),
    ("troupe.v1.Coordinator", "WatchSession", CLIENT),
    ("troupe.v1.Coordinator", "CheckSession", CLIENT),
    ("troupe.v1.Coordinator", "ResumeSession", CLIENT),
    ("troupe.v1.Coordinator", "PauseSession", CLIENT),
    ("troupe.v1.Coordinator", "ListMessages", CLIENT),
    ("troupe.v1.Coordinator", "GetState", CLIENT),
    // A person's answer at an approval gate.
    ("troupe.v1.Coordinator", "ApproveTask", CLIENT),
    ("troupe.v1.Coordinator", "RejectTask", CLIENT),
    ("troupe.v1.Coordinator", "ClaimTasks", WORKER),
    ("troupe.v1.Coordinator", "Heartbeat", WORKER),
    ("troupe.v1.Coordinator", "CompleteTask", WORKER),
    ("troupe.v1.Coordinator", "FailTask", WORKER),
    // The files a plan brought along, fetched by the workers that run its tasks.
    ("troupe.v1.Coordinator", "GetPlanAssets", WORKER),
    // Workers post messages and their role state (the test-runner's CCW state_update);
    // clients do too (CCW's team_msg is open to the operator).
    ("troupe.v1.Coordinator", "LogMessage", BOTH),
    ("troupe.v1.Coordinator", "UpdateState", BOTH),
    ("troupe.v1.Executor", "ExecuteTask", CLIENT),
    ("troupe.v1.Executor", "ListBackends", CLIENT),
    ("troupe.v1.TestRunner", "RunTests", CLIENT),
    // The executor self-validates each task with the validator.
    ("troupe.v1.Validator", "Validate", BOTH),
];

const HEALTH: &str = "/grpc.health.v1.Health/";
const REFLECTION: [&str; 2] = [
    "/grpc.reflection.v1.ServerReflection/",
    "/grpc.reflection.v1alpha.ServerReflection/",
];

/// What a request to `path` (`/package.Service/Method`) needs.
pub fn rule(path: &str, reflection: Reflection) -> Rule {
    let admin_only = Rule::Needs(Scopes::NONE);
    if path.starts_with(HEALTH) {
        return Rule::Open;
    }
    if REFLECTION.iter().any(|prefix| path.starts_with(prefix)) {
        return match reflection {
            Reflection::Open => Rule::Open,
            Reflection::Authenticated => Rule::Needs(Scopes::of(&Scope::ALL)),
            Reflection::Off => admin_only,
        };
    }
    let Some((service, method)) = path.strip_prefix('/').and_then(|p| p.split_once('/')) else {
        return admin_only;
    };
    RPCS.iter()
        .find(|(s, m, _)| *s == service && *m == method)
        .map_or(admin_only, |(_, _, scopes)| Rule::Needs(Scopes::of(scopes)))
}

/// Whether `held` satisfies `needed` (`admin` satisfies everything).
pub fn allows(held: Scopes, needed: Scopes) -> bool {
    held.contains(Scope::Admin) || held.intersects(needed)
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::*;

    #[test]
    fn every_rpc_of_the_protocol_has_a_rule_and_no_rule_is_stale() {
        let set = prost_types::FileDescriptorSet::decode(troupe_proto::FILE_DESCRIPTOR_SET)
            .expect("descriptor set decodes");
        let mut declared = Vec::new();
        for file in &set.file {
            for service in &file.service {
                for method in &service.method {
                    declared.push((
                        format!("{}.{}", file.package(), service.name()),
                        method.name().to_owned(),
                    ));
                }
            }
        }
        for (service, method) in &declared {
            assert!(
                RPCS.iter().any(|(s, m, _)| s == service && m == method),
                "{service}/{method} has no rule in auth::policy::RPCS"
            );
        }
        for (service, method, _) in RPCS {
            assert!(
                declared.iter().any(|(s, m)| s == service && m == method),
                "{service}/{method} is in RPCS but not in the protocol"
            );
        }
    }

    #[test]
    fn scopes_decide() {
        let worker = Scopes::of(&[Scope::Worker]);
        let client = Scopes::of(&[Scope::Client]);
        let admin = Scopes::of(&[Scope::Admin]);
        let Rule::Needs(claim) = rule("/troupe.v1.Coordinator/ClaimTasks", Reflection::Open) else {
            panic!("claim is not open")
        };
        assert!(allows(worker, claim) && allows(admin, claim) && !allows(client, claim));
        let Rule::Needs(create) = rule("/troupe.v1.Coordinator/CreateSession", Reflection::Open)
        else {
            panic!("create is not open")
        };
        assert!(!allows(worker, create) && allows(client, create));
        let Rule::Needs(unknown) = rule("/troupe.v1.Coordinator/Nope", Reflection::Open) else {
            panic!("unknown is not open")
        };
        assert!(!allows(client, unknown) && allows(admin, unknown));
        assert_eq!(
            rule("/grpc.health.v1.Health/Check", Reflection::Off),
            Rule::Open
        );
        let reflect = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo";
        assert_eq!(rule(reflect, Reflection::Open), Rule::Open);
        assert!(
            matches!(rule(reflect, Reflection::Authenticated), Rule::Needs(s) if allows(worker, s))
        );
    }
}
