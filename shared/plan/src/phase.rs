//! EXEC phases (CCW roadmap mode, ccw-reference §1.B.2): an `EXEC-` task with a `phase` runs
//! that phase's task files, `phase-N/.task/IMPL-*.json` beside the plan, in waves.
//!
//! The files are read once, at intake ([`attach`]), and travel in the stored plan as the EXEC
//! task's `phase_tasks`, so no worker reads the plan's directory. [`Phase::from_specs`]
//! validates them as plan tasks of their own (the same checks as any task of a plan) and
//! takes their waves from the plan's dependency code: a dependency outside the phase is an
//! earlier phase's task and counts as met; a cycle is an error and nothing runs.

use serde_json::{Map, Value};

use crate::{Plan, PlanError, Problem, ProblemKind, Role, TaskKind};

/// The key of an EXEC task's spec that holds its phase's task objects.
pub const PHASE_TASKS: &str = "phase_tasks";

/// The directory, relative to the plan's, that an EXEC task's `phase` names: a number `N`
/// names `phase-N`, a string a directory inside the plan's. `None` when there is no `phase`.
pub fn directory(spec: &Map<String, Value>) -> Option<Result<String, String>> {
    let phase = spec.get("phase").filter(|value| !value.is_null())?;
    let relative = match phase {
        Value::Number(n) if n.as_u64().is_some() => format!("phase-{n}"),
        Value::String(s) if !s.is_empty() && s.chars().all(|c| c.is_ascii_digit()) => {
            format!("phase-{s}")
        }
        Value::String(s) if !s.trim().is_empty() => s.trim().trim_end_matches('/').to_owned(),
        _ => {
            return Some(Err(
                "`phase` must be a phase number or a directory".to_owned()
            ));
        }
    };
    if crate::validate::escapes_root(&relative) || relative.contains('\\') {
        return Some(Err(format!(
            "phase directory `{relative}` must stay inside the plan directory"
        )));
    }
    Some(Ok(relative))
}

/// Whether `path` (relative to the plan's directory, `/`-separated) is a task file of the
/// phase directory `dir`: `<dir>/.task/IMPL-*.json`.
pub fn is_task_file(dir: &str, path: &str) -> bool {
    path.strip_prefix(dir)
        .and_then(|rest| rest.strip_prefix("/.task/"))
        .is_some_and(|name| {
            !name.contains('/') && name.starts_with("IMPL-") && name.ends_with(".json")
        })
}

/// One task of a phase.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseTask {
    /// Its id.
    pub id: String,
    /// Its `depends_on`, as written (dependencies outside the phase included).
    pub depends_on: Vec<String>,
    /// Its 1-based wave inside the phase.
    pub wave: u32,
    /// The task object as written.
    pub spec: Map<String, Value>,
}

/// The validated tasks of an EXEC phase.
#[derive(Debug, Clone, PartialEq)]
pub struct Phase {
    /// Tasks by wave, then in the order given (file-name order at intake).
    pub tasks: Vec<PhaseTask>,
}

impl Phase {
    /// Validates the phase task objects of EXEC task `owner` and computes their waves.
    ///
    /// Each object is checked as a task of a plan (every problem is reported, each prefixed
    /// with `task <owner>: phase task`); phase tasks run in the EXEC task's repository, so
    /// they must be executor tasks and may name no other `repo` than `repo`.
    pub fn from_specs(owner: &str, repo: &str, specs: &[Value]) -> Result<Self, PlanError> {
        let prefix = format!("task {owner}: `{PHASE_TASKS}`");
        let mut problems = Vec::new();
        let mut problem = |kind, message: String| {
            problems.push(Problem {
                kind,
                message: format!("{prefix}: {message}"),
            })
        };
        if specs.is_empty() {
            problem(
                ProblemKind::MissingField,
                "the phase has no tasks".to_owned(),
            );
        }
        let ids: Vec<&str> = specs
            .iter()
            .filter_map(|spec| spec.get("id").and_then(Value::as_str))
            .collect();
        // The dependency graph inside the phase is the plan's; what lies outside it is met.
        let mut inner = Vec::with_capacity(specs.len());
        for spec in specs {
            let Some(object) = spec.as_object() else {
                inner.push(spec.clone());
                continue;
            };
            let id = object.get("id").and_then(Value::as_str).unwrap_or_default();
            if TaskKind::from_id(id) == Some(TaskKind::Exec) {
                problem(
                    ProblemKind::InvalidValue,
                    format!("task {id}: an EXEC task cannot be part of a phase"),
                );
            }
            match object.get("repo") {
                None | Some(Value::Null) => {}
                Some(Value::String(name)) if name == repo => {}
                Some(other) => problem(
                    ProblemKind::UnknownRepo,
                    format!("task {id}: repo {other} is not its EXEC task's repository `{repo}`"),
                ),
            }
            let mut object = object.clone();
            object.remove("repo");
            if let Some(Value::Array(deps)) = object.get_mut("depends_on") {
                deps.retain(|dep| dep.as_str().is_none_or(|dep| ids.contains(&dep)));
            }
            inner.push(Value::Object(object));
        }
        let document = serde_json::json!({"name": "phase", "tasks": inner});
        let plan = match Plan::from_json(&document.to_string()) {
            Ok(plan) => Some(plan),
            Err(err) => {
                for found in err.problems {
                    problem(found.kind, found.message);
                }
                None
            }
        };
        if let Some(plan) = &plan {
            for task in &plan.tasks {
                if task.role != Role::Executor {
                    problem(
                        ProblemKind::UnknownRole,
                        format!(
                            "task {}: a phase runs executor tasks only, not {} tasks",
                            task.id, task.role
                        ),
                    );
                }
            }
        }
        let (Some(plan), true) = (plan, problems.is_empty()) else {
            return Err(PlanError { problems });
        };
        let tasks = plan
            .tasks
            .into_iter()
            .map(|task| {
                let spec = specs[task.plan_index]
                    .as_object()
                    .cloned()
                    .unwrap_or_default();
                let depends_on = spec
                    .get("depends_on")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect();
                PhaseTask {
                    id: task.id,
                    depends_on,
                    wave: task.wave,
                    spec,
                }
            })
            .collect();
        Ok(Self { tasks })
    }

    /// The phase's tasks grouped by wave, as indices into [`Phase::tasks`]; index 0 holds
    /// wave 1.
    pub fn waves(&self) -> Vec<Vec<usize>> {
        let count = self.tasks.iter().map(|task| task.wave).max().unwrap_or(0) as usize;
        let mut waves = vec![Vec::new(); count];
        for (index, task) in self.tasks.iter().enumerate() {
            waves[task.wave as usize - 1].push(index);
        }
        waves
    }
}

/// Parses a phase's task files (`(path, bytes)`, sorted by path) into task objects; a file
/// that is not a JSON object is a problem naming it.
pub fn parse_files<'a>(
    owner: &str,
    files: impl IntoIterator<Item = (&'a str, &'a [u8])>,
) -> Result<Vec<Value>, Vec<Problem>> {
    let mut specs = Vec::new();
    let mut problems = Vec::new();
    for (path, bytes) in files {
        match serde_json::from_slice::<Value>(bytes) {
            Ok(value @ Value::Object(_)) => specs.push(value),
            Ok(_) => problems.push(Problem {
                kind: ProblemKind::MalformedJson,
                message: format!("task {owner}: phase task file {path} is not a JSON object"),
            }),
            Err(err) => problems.push(Problem {
                kind: ProblemKind::MalformedJson,
                message: format!("task {owner}: phase task file {path} is not valid JSON: {err}"),
            }),
        }
    }
    if problems.is_empty() {
        Ok(specs)
    } else {
        Err(problems)
    }
}

/// Gives every EXEC task of `plan` that names a `phase` its `phase_tasks`, validated: read
/// with `files(dir)` (the task files of the phase directory `dir` as `(path, bytes)`, sorted
/// by path, or why they cannot be read) unless the plan already gives them inline. Reports
/// every problem of every phase at once.
pub fn attach(
    plan: &mut Plan,
    mut files: impl FnMut(&str) -> Result<Vec<(String, Vec<u8>)>, String>,
) -> Result<(), PlanError> {
    let mut problems = Vec::new();
    for task in &mut plan.tasks {
        if TaskKind::from_id(&task.id) != Some(TaskKind::Exec) {
            continue;
        }
        let specs = match (task.spec.get(PHASE_TASKS), directory(&task.spec)) {
            (Some(Value::Array(specs)), _) => specs.clone(),
            (Some(_), _) => {
                problems.push(Problem {
                    kind: ProblemKind::InvalidValue,
                    message: format!(
                        "task {}: `{PHASE_TASKS}` must be an array of task objects",
                        task.id
                    ),
                });
                continue;
            }
            (None, None) => continue,
            (None, Some(Err(message))) => {
                problems.push(Problem {
                    kind: ProblemKind::PathEscape,
                    message: format!("task {}: {message}", task.id),
                });
                continue;
            }
            (None, Some(Ok(dir))) => {
                let found = match files(&dir) {
                    Ok(found) => found,
                    Err(why) => {
                        problems.push(Problem {
                            kind: ProblemKind::MissingField,
                            message: format!("task {}: phase `{dir}`: {why}", task.id),
                        });
                        continue;
                    }
                };
                if found.is_empty() {
                    problems.push(Problem {
                        kind: ProblemKind::MissingField,
                        message: format!(
                            "task {}: phase `{dir}` has no task files ({dir}/.task/IMPL-*.json)",
                            task.id
                        ),
                    });
                    continue;
                }
                let parsed = parse_files(
                    &task.id,
                    found
                        .iter()
                        .map(|(path, bytes)| (path.as_str(), bytes.as_slice())),
                );
                match parsed {
                    Ok(specs) => specs,
                    Err(found) => {
                        problems.extend(found);
                        continue;
                    }
                }
            }
        };
        match Phase::from_specs(&task.id, &task.repo, &specs) {
            Ok(_) => {
                task.spec
                    .insert(PHASE_TASKS.to_owned(), Value::Array(specs));
            }
            Err(err) => problems.extend(err.problems),
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(PlanError { problems })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn task(id: &str, deps: &[&str]) -> Value {
        json!({"id": id, "title": format!("task {id}"), "depends_on": deps})
    }

    #[test]
    fn waves_follow_depends_on_and_outside_dependencies_are_met() {
        let specs = [
            task("IMPL-101", &[]),
            task("IMPL-102", &[]),
            task("IMPL-103", &["IMPL-101"]),
            task("IMPL-104", &["IMPL-101", "IMPL-102"]),
            task("IMPL-105", &["IMPL-103", "IMPL-004"]),
        ];
        let phase = Phase::from_specs("EXEC-1", "app", &specs).expect("valid phase");
        let waves: Vec<Vec<&str>> = phase
            .waves()
            .iter()
            .map(|wave| wave.iter().map(|&i| phase.tasks[i].id.as_str()).collect())
            .collect();
        assert_eq!(
            waves,
            [
                vec!["IMPL-101", "IMPL-102"],
                vec!["IMPL-103", "IMPL-104"],
                vec!["IMPL-105"]
            ]
        );
        // The outside dependency stays as written.
        assert_eq!(phase.tasks[4].depends_on, ["IMPL-103", "IMPL-004"]);
    }

    #[test]
    fn cycles_and_bad_tasks_are_all_reported() {
        let specs = [
            task("IMPL-1", &[]),
            task("IMPL-2", &["IMPL-3"]),
            task("IMPL-3", &["IMPL-2"]),
            json!({"id": "VALIDATE-1", "title": "check"}),
            json!({"id": "IMPL-4", "title": "elsewhere", "repo": "other"}),
            json!({"id": "IMPL-5"}),
        ];
        let err = Phase::from_specs("EXEC-1", "app", &specs).expect_err("invalid");
        let text = err.to_string();
        assert!(err.has(ProblemKind::Cycle), "{text}");
        assert!(
            text.contains(
                "task EXEC-1: `phase_tasks`: dependency cycle: IMPL-2 -> IMPL-3 -> IMPL-2"
            ),
            "{text}"
        );
        assert!(
            text.contains("IMPL-5: missing required field `title`"),
            "{text}"
        );
        assert!(text.contains("IMPL-4: repo \"other\""), "{text}");
        // Roles are checked once the phase parses.
        let err = Phase::from_specs(
            "EXEC-1",
            "app",
            &[json!({"id": "VALIDATE-1", "title": "c"})],
        )
        .expect_err("not an executor task");
        assert!(err.has(ProblemKind::UnknownRole), "{err}");
    }

    #[test]
    fn directories_stay_in_the_plan() {
        let dir = |v: Value| {
            let spec = json!({"phase": v});
            directory(spec.as_object().expect("object"))
        };
        assert_eq!(dir(json!(2)), Some(Ok("phase-2".to_owned())));
        assert_eq!(dir(json!("3")), Some(Ok("phase-3".to_owned())));
        assert_eq!(
            dir(json!("phases/auth")),
            Some(Ok("phases/auth".to_owned()))
        );
        assert!(matches!(dir(json!("../x")), Some(Err(_))));
        assert!(matches!(dir(json!("/etc")), Some(Err(_))));
        assert!(matches!(dir(json!(true)), Some(Err(_))));
        assert_eq!(dir(Value::Null), None);
        assert!(is_task_file("phase-1", "phase-1/.task/IMPL-101.json"));
        assert!(!is_task_file("phase-1", "phase-1/.task/notes.md"));
        assert!(!is_task_file("phase-1", "phase-10/.task/IMPL-101.json"));
        assert!(!is_task_file("phase-1", "phase-1/.task/sub/IMPL-1.json"));
    }

    #[test]
    fn attach_fills_phase_tasks_and_reports_every_phase() {
        let plan_json = json!({"name": "p", "tasks": [
            {"id": "EXEC-1", "title": "one", "phase": 1},
            {"id": "EXEC-2", "title": "two", "phase": 2, "depends_on": ["EXEC-1"]},
            {"id": "EXEC-3", "title": "three", "phase_tasks": [task("IMPL-9", &[])]},
            {"id": "IMPL-1", "title": "plain", "phase": 1}
        ]});
        let mut plan = Plan::from_json(&plan_json.to_string()).expect("plan");
        let read = |dir: &str| -> Result<Vec<(String, Vec<u8>)>, String> {
            match dir {
                "phase-1" => Ok(vec![(
                    "phase-1/.task/IMPL-101.json".to_owned(),
                    task("IMPL-101", &[]).to_string().into_bytes(),
                )]),
                _ => Ok(Vec::new()),
            }
        };
        let err = attach(&mut plan.clone(), read).expect_err("phase 2 is empty");
        assert_eq!(err.problems.len(), 1, "{err}");
        assert!(
            err.to_string()
                .contains("task EXEC-2: phase `phase-2` has no task files")
        );

        plan.tasks.retain(|task| task.id != "EXEC-2");
        attach(&mut plan, read).expect("attached");
        let exec = plan.task("EXEC-1").expect("EXEC-1");
        assert_eq!(exec.spec[PHASE_TASKS][0]["id"], "IMPL-101");
        assert_eq!(
            plan.task("EXEC-3").expect("EXEC-3").spec[PHASE_TASKS][0]["id"],
            "IMPL-9"
        );
        assert!(
            !plan
                .task("IMPL-1")
                .expect("IMPL-1")
                .spec
                .contains_key(PHASE_TASKS)
        );
    }
}
