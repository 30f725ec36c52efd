//! The Kubernetes manifests and the image as written: every overlay renders with kubectl's
//! kustomize and validates strictly against the Kubernetes API schema offline
//! (`kubernetes-validate`); every troupe container's flags are ones its binary's `--help`
//! lists, its ports are the ones those flags open, its probes ask for the service the real
//! binary reports SERVING on its health listener; every container is locked down and bounded;
//! every autoscaler targets a Deployment on that Deployment's ready-task depth; every Secret
//! the pods need is made by the overlay or created by docs/kubernetes.md. The Dockerfile
//! passes hadolint. The Grafana dashboard is JSON whose every query reads a metric a running
//! coordinator or worker serves. The tools come from scripts/setup/60-deploy-tools.sh.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail, ensure};
use serde_json::Value;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::support::{ChildService, binary, free_addr, health};

/// The lease a worker asks for unless `--lease-seconds` says otherwise (WorkerTuning).
const DEFAULT_LEASE_SECONDS: f64 = 30.0;

fn root() -> PathBuf {
    troupe_testkit::workspace_root()
}

/// A tool the setup scripts install, found on PATH.
fn tool(name: &str) -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join(name))
                .find(|candidate| candidate.is_file())
        })
        .unwrap_or_else(|| {
            panic!("`{name}` is not on PATH: scripts/test installs it (scripts/setup/60-deploy-tools.sh)")
        })
}

fn run(program: &Path, args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {}", program.display()))?;
    ensure!(
        output.status.success(),
        "{} {args:?} failed ({}):\n{}{}",
        program.display(),
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?)
}

/// The objects of a rendered overlay, as JSON (through the tools venv's PyYAML, which
/// kubernetes-validate brings).
fn objects(rendered: &Path) -> anyhow::Result<Vec<Value>> {
    let python = std::env::var_os("TROUPE_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| tool("python3"));
    let json = run(
        &python,
        &[
            "-c",
            "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d]))",
            &rendered.display().to_string(),
        ],
    )?;
    Ok(serde_json::from_str(&json)?)
}

fn name(object: &Value) -> String {
    format!(
        "{}/{}",
        object["kind"].as_str().unwrap_or("?"),
        object["metadata"]["name"].as_str().unwrap_or("?")
    )
}

/// The long flags a binary's `--help` lists.
fn help_flags(bin: &str) -> anyhow::Result<BTreeSet<String>> {
    let help = run(&binary(bin), &["--help"])?;
    Ok(help
        .split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']' || c == '=')
        .filter(|word| word.starts_with("--") && word.len() > 2)
        .map(|word| {
            word.trim_end_matches(|c: char| !c.is_ascii_alphanumeric())
                .to_owned()
        })
        .collect())
}

/// The value after `flag` in `args`.
fn flag<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter()
        .position(|arg| arg == flag)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn port_of(addr: &str) -> anyhow::Result<i64> {
    addr.rsplit(':')
        .next()
        .and_then(|port| port.parse().ok())
        .with_context(|| format!("no port in {addr:?}"))
}

fn container_port(container: &Value, port_name: &str) -> Option<i64> {
    container["ports"]
        .as_array()?
        .iter()
        .find(|port| port["name"] == port_name)
        .and_then(|port| port["containerPort"].as_i64())
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|items| {
            items
                .iter()
                .filter_map(|item| item.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// What one overlay's troupe containers need from the real binaries: the health service name
/// each probe asks for, by binary.
type Probes = BTreeSet<(String, String)>;

/// Checks one workload's pod; returns the (binary, readiness service) pairs it probes.
fn check_workload(
    workload: &Value,
    helps: &mut BTreeMap<String, BTreeSet<String>>,
) -> anyhow::Result<Probes> {
    let what = name(workload);
    let pod = &workload["spec"]["template"]["spec"];
    let pod_security = &pod["securityContext"];
    ensure!(
        pod_security["seccompProfile"]["type"] == "RuntimeDefault",
        "{what}: seccomp RuntimeDefault"
    );
    ensure!(pod_security["runAsNonRoot"] == true, "{what}: runAsNonRoot");
    ensure!(
        pod_security["runAsUser"]
            .as_i64()
            .is_some_and(|uid| uid > 0),
        "{what}: a numeric non-root runAsUser"
    );
    let mut probes = Probes::new();
    let containers = pod["containers"].as_array().context("containers")?;
    for container in containers {
        let what = format!("{what} container {}", container["name"]);
        let security = &container["securityContext"];
        ensure!(
            security["readOnlyRootFilesystem"] == true,
            "{what}: readOnlyRootFilesystem"
        );
        ensure!(
            security["allowPrivilegeEscalation"] == false,
            "{what}: allowPrivilegeEscalation false"
        );
        ensure!(
            strings(&security["capabilities"]["drop"]) == ["ALL"],
            "{what}: capabilities drop ALL"
        );
        for bound in ["requests", "limits"] {
            for resource in ["cpu", "memory"] {
                ensure!(
                    container["resources"][bound][resource].is_string(),
                    "{what}: resources.{bound}.{resource}"
                );
            }
        }
        // Where the root filesystem is read-only, /tmp must be a volume.
        let mounts: BTreeSet<String> = container["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|mount| mount["mountPath"].as_str().map(str::to_owned))
            .collect();
        ensure!(mounts.contains("/tmp"), "{what}: a writable /tmp");

        let command = strings(&container["command"]);
        let Some(bin) = command.first().filter(|bin| bin.starts_with("troupe")) else {
            continue;
        };
        ensure!(command.len() == 1, "{what}: command is the binary alone");
        if !helps.contains_key(bin) {
            helps.insert(bin.clone(), help_flags(bin)?);
        }
        let known = &helps[bin];
        let args = strings(&container["args"]);
        for arg in args.iter().filter(|arg| arg.starts_with("--")) {
            ensure!(
                known.contains(arg.as_str()),
                "{what}: {bin} --help lists no {arg} (it lists {known:?})"
            );
        }
        for mount in [
            "/var/lib/troupe",
            "/home/troupe",
            "/etc/troupe/tls",
            "/etc/troupe/auth",
        ] {
            ensure!(mounts.contains(mount), "{what}: mounts {mount}");
        }
        ensure!(
            flag(&args, "--data-dir") == Some("/var/lib/troupe"),
            "{what}: --data-dir on its volume"
        );
        let grpc = port_of(flag(&args, "--listen").context("--listen")?)?;
        ensure!(
            container_port(container, "grpc") == Some(grpc),
            "{what}: port `grpc` is --listen's {grpc}"
        );
        let health_port = port_of(flag(&args, "--health-listen").context("--health-listen")?)?;
        ensure!(
            container_port(container, "health") == Some(health_port),
            "{what}: port `health` is --health-listen's {health_port}"
        );
        let metrics = port_of(flag(&args, "--metrics-listen").context("--metrics-listen")?)?;
        ensure!(
            container_port(container, "metrics") == Some(metrics),
            "{what}: port `metrics` is --metrics-listen's {metrics}"
        );
        let annotations = &workload["spec"]["template"]["metadata"]["annotations"];
        ensure!(
            annotations["prometheus.io/port"].as_str() == Some(metrics.to_string().as_str()),
            "{what}: scraped on its metrics port"
        );
        let readiness = &container["readinessProbe"]["grpc"];
        let liveness = &container["livenessProbe"]["grpc"];
        ensure!(
            readiness["port"] == health_port && liveness["port"] == health_port,
            "{what}: both probes on the health port {health_port}"
        );
        // Liveness asks for the whole server: a worker cut off from its coordinator is not
        // ready, but restarting it would not help.
        ensure!(
            liveness["service"].as_str().unwrap_or("").is_empty(),
            "{what}: liveness asks for the server's overall health"
        );
        let service = readiness["service"]
            .as_str()
            .with_context(|| format!("{what}: readiness names its service"))?;
        probes.insert((bin.clone(), service.to_owned()));

        if bin != "troupe-coordinator" {
            let lease = flag(&args, "--lease-seconds")
                .map(str::parse::<f64>)
                .transpose()?
                .unwrap_or(DEFAULT_LEASE_SECONDS);
            let grace = pod["terminationGracePeriodSeconds"]
                .as_f64()
                .context("terminationGracePeriodSeconds")?;
            ensure!(
                grace > lease,
                "{what}: grace {grace} s longer than a lease ({lease} s)"
            );
            let coordinator = flag(&args, "--coordinator-url").context("--coordinator-url")?;
            ensure!(
                coordinator == "https://coordinator:7071",
                "{what}: claims from the coordinator Service over TLS"
            );
        }
    }
    Ok(probes)
}

/// Checks that each Service's ports reach a named container port of the pods it selects,
/// and that a URL `https://<service>:<port>` in a container's args names such a Service.
fn check_services(objects: &[Value]) -> anyhow::Result<()> {
    let workloads: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "Deployment" || o["kind"] == "StatefulSet")
        .collect();
    let mut served = BTreeSet::new();
    for service in objects.iter().filter(|o| o["kind"] == "Service") {
        let what = name(service);
        let selector = service["spec"]["selector"]
            .as_object()
            .context("selector")?;
        let pods: Vec<&Value> = workloads
            .iter()
            .map(|w| &w["spec"]["template"])
            .filter(|t| {
                selector
                    .iter()
                    .all(|(k, v)| &t["metadata"]["labels"][k] == v)
            })
            .collect();
        ensure!(!pods.is_empty(), "{what}: selects no pod");
        for port in service["spec"]["ports"].as_array().context("ports")? {
            let target = port["targetPort"].as_str().context("a named targetPort")?;
            ensure!(
                pods.iter().all(|pod| pod["spec"]["containers"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| container_port(c, target).is_some())),
                "{what}: targetPort {target} is no container port"
            );
            served.insert(format!(
                "{}:{}",
                service["metadata"]["name"].as_str().unwrap_or(""),
                port["port"]
            ));
        }
    }
    for workload in &workloads {
        for container in workload["spec"]["template"]["spec"]["containers"]
            .as_array()
            .into_iter()
            .flatten()
        {
            for arg in strings(&container["args"]) {
                if let Some(host_port) = arg.strip_prefix("https://") {
                    ensure!(
                        served.contains(host_port),
                        "{}: {arg} names no Service port (have {served:?})",
                        name(workload)
                    );
                }
            }
        }
    }
    let executor = workloads
        .iter()
        .find(|w| w["metadata"]["name"] == "executor")
        .context("an executor Deployment")?;
    let args = strings(&executor["spec"]["template"]["spec"]["containers"][0]["args"]);
    ensure!(
        flag(&args, "--validator-url") == Some("https://validator:7074"),
        "the executor self-validates with the validator Service"
    );
    Ok(())
}

/// Checks that no HPA scales on CPU without requests, and that each KEDA ScaledObject (a CRD
/// kubernetes-validate has no schema for, so checked here by hand, field by field) scales an
/// existing Deployment on that Deployment's role's ready-task depth.
fn check_autoscaling(objects: &[Value]) -> anyhow::Result<()> {
    ensure!(
        !objects
            .iter()
            .any(|o| o["kind"] == "HorizontalPodAutoscaler"),
        "no HPA: workers scale on ready work through KEDA"
    );
    let scaled: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "ScaledObject")
        .collect();
    let mut targets = BTreeSet::new();
    for object in &scaled {
        let what = name(object);
        ensure!(
            object["apiVersion"] == "keda.sh/v1alpha1",
            "{what}: apiVersion"
        );
        let spec = object["spec"].as_object().context("spec")?;
        let allowed = [
            "scaleTargetRef",
            "minReplicaCount",
            "maxReplicaCount",
            "cooldownPeriod",
            "pollingInterval",
            "triggers",
        ];
        for key in spec.keys() {
            ensure!(
                allowed.contains(&key.as_str()),
                "{what}: unexpected spec.{key}"
            );
        }
        let target = &spec["scaleTargetRef"];
        ensure!(
            target["apiVersion"] == "apps/v1" && target["kind"] == "Deployment",
            "{what}: scales a Deployment"
        );
        let target_name = target["name"].as_str().context("scaleTargetRef.name")?;
        let deployment = objects
            .iter()
            .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == target_name)
            .with_context(|| format!("{what}: no Deployment {target_name}"))?;
        let bin = strings(&deployment["spec"]["template"]["spec"]["containers"][0]["command"]);
        let role = bin
            .first()
            .and_then(|bin| bin.strip_prefix("troupe-"))
            .with_context(|| format!("{what}: {target_name} runs no troupe worker"))?;
        ensure!(
            spec["minReplicaCount"].as_i64() >= Some(1)
                && spec["maxReplicaCount"].as_i64() > spec["minReplicaCount"].as_i64(),
            "{what}: replica bounds"
        );
        let triggers = spec["triggers"].as_array().context("triggers")?;
        ensure!(triggers.len() == 1, "{what}: one trigger");
        let trigger = &triggers[0];
        ensure!(
            trigger["type"] == "prometheus",
            "{what}: a prometheus trigger"
        );
        let metadata = &trigger["metadata"];
        let query = metadata["query"].as_str().context("query")?;
        ensure!(
            query.contains(&format!("troupe_tasks_ready{{role=\"{role}\"}}")),
            "{what}: scales on troupe_tasks_ready of role {role}, not {query:?}"
        );
        ensure!(
            metadata["serverAddress"]
                .as_str()
                .is_some_and(|a| a.starts_with("http")),
            "{what}: serverAddress"
        );
        ensure!(
            metadata["threshold"]
                .as_str()
                .and_then(|t| t.parse::<f64>().ok())
                .is_some_and(|t| t > 0.0),
            "{what}: a positive threshold, as a string"
        );
        targets.insert(target_name.to_owned());
    }
    let workers: BTreeSet<String> = ["executor", "test-runner", "validator"]
        .map(str::to_owned)
        .into();
    ensure!(
        targets == workers,
        "every worker Deployment scales: {targets:?}"
    );
    Ok(())
}

/// Every Secret and ConfigMap a pod reads is made by the overlay, or created by a
/// `kubectl create secret` command of docs/kubernetes.md.
fn check_references(objects: &[Value], documented: &BTreeSet<String>) -> anyhow::Result<()> {
    let made: BTreeSet<String> = objects
        .iter()
        .filter(|o| o["kind"] == "Secret" || o["kind"] == "ConfigMap")
        .map(|o| o["metadata"]["name"].as_str().unwrap_or("").to_owned())
        .collect();
    let mut referenced = BTreeSet::new();
    fn walk(value: &Value, out: &mut BTreeSet<String>) {
        match value {
            Value::Object(map) => {
                for (key, inner) in map {
                    match key.as_str() {
                        "secretName" => {
                            out.extend(inner.as_str().map(str::to_owned));
                        }
                        "secretKeyRef" | "secretRef" | "configMap" | "configMapRef" => {
                            out.extend(inner["name"].as_str().map(str::to_owned));
                        }
                        _ => {}
                    }
                    walk(inner, out);
                }
            }
            Value::Array(items) => items.iter().for_each(|item| walk(item, out)),
            _ => {}
        }
    }
    for object in objects {
        walk(&object["spec"], &mut referenced);
    }
    for name in &referenced {
        ensure!(
            made.contains(name) || documented.contains(name),
            "{name} is neither made by the overlay nor created in docs/kubernetes.md"
        );
    }
    Ok(())
}

/// The Secret names docs/kubernetes.md creates with `kubectl ... create secret <type> <name>`.
fn documented_secrets() -> anyhow::Result<BTreeSet<String>> {
    let doc = std::fs::read_to_string(root().join("docs/kubernetes.md"))?;
    let mut names = BTreeSet::new();
    for line in doc.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if let Some(i) = words
            .windows(2)
            .position(|pair| pair == ["create", "secret"])
        {
            names.extend(words.get(i + 3).map(|name| (*name).to_owned()));
        }
    }
    ensure!(!names.is_empty(), "docs/kubernetes.md creates no Secret");
    Ok(names)
}

#[tokio::test]
async fn every_overlay_renders_validates_and_matches_the_binaries() -> anyhow::Result<()> {
    let kubectl = tool("kubectl");
    let validate = tool("kubernetes-validate");
    let documented = documented_secrets()?;
    let dir = tempfile::tempdir()?;
    let mut helps = BTreeMap::new();
    let mut probes = Probes::new();
    for overlay in ["dev", "prod"] {
        let path = root().join("deploy/k8s/overlays").join(overlay);
        let rendered = run(&kubectl, &["kustomize", &path.display().to_string()])
            .with_context(|| format!("rendering the {overlay} overlay"))?;
        let file = dir.path().join(format!("{overlay}.yaml"));
        std::fs::write(&file, &rendered)?;
        // Strict: an unknown field anywhere fails. CRDs (the KEDA ScaledObjects) have no
        // schema here; check_autoscaling checks them.
        let report = run(
            &validate,
            &["--strict", "--quiet", &file.display().to_string()],
        )
        .with_context(|| format!("validating the {overlay} overlay"))?;
        for line in report.lines() {
            ensure!(
                line.contains("Couldn't find schema for kind ScaledObject"),
                "{overlay}: {line}"
            );
        }
        let objects = objects(&file)?;
        let workloads: Vec<&Value> = objects
            .iter()
            .filter(|o| o["kind"] == "Deployment" || o["kind"] == "StatefulSet")
            .collect();
        for workload in &workloads {
            probes.extend(
                check_workload(workload, &mut helps)
                    .with_context(|| format!("the {overlay} overlay"))?,
            );
        }
        check_services(&objects).with_context(|| format!("the {overlay} overlay"))?;
        check_autoscaling(&objects).with_context(|| format!("the {overlay} overlay"))?;
        check_references(&objects, &documented)
            .with_context(|| format!("the {overlay} overlay"))?;

        let coordinators = workloads
            .iter()
            .find(|w| w["metadata"]["name"] == "coordinator")
            .and_then(|w| w["spec"]["replicas"].as_i64())
            .context("a coordinator")?;
        let pdbs = objects
            .iter()
            .filter(|o| o["kind"] == "PodDisruptionBudget")
            .count();
        let postgres = objects
            .iter()
            .any(|o| o["kind"] == "StatefulSet" && o["metadata"]["name"] == "postgres");
        match overlay {
            "dev" => ensure!(
                coordinators == 1 && postgres,
                "dev: one coordinator, PostgreSQL in the cluster"
            ),
            _ => ensure!(
                coordinators >= 2 && !postgres && pdbs == 4,
                "prod: two or more coordinators on an external PostgreSQL, a PDB per Deployment"
            ),
        }
        ensure!(
            objects.iter().any(|o| o["kind"] == "NetworkPolicy"
                && o["spec"]["podSelector"] == serde_json::json!({})
                && strings(&o["spec"]["policyTypes"]) == ["Ingress", "Egress"]
                && o["spec"].get("ingress").is_none()
                && o["spec"].get("egress").is_none()),
            "{overlay}: a default-deny NetworkPolicy"
        );
    }

    // The real binaries serve those names on their health listener.
    for (bin, service) in &probes {
        let data = dir.path().join(bin);
        let health_addr = free_addr();
        let child = ChildService::start(
            bin,
            &[
                "--data-dir",
                &data.display().to_string(),
                "--health-listen",
                &health_addr.to_string(),
            ],
            &[],
        )
        .await?;
        let url = format!("http://{health_addr}");
        for name in [service.as_str(), ""] {
            let status = health(&url, name)
                .await
                .with_context(|| format!("{bin}: health of {name:?} on its health listener"))?;
            if status != ServingStatus::Serving {
                bail!("{bin} answers {status:?} for {name:?} on its health listener");
            }
        }
        child.terminate(std::time::Duration::from_secs(20)).await?;
    }
    let bins: BTreeSet<&str> = probes.iter().map(|(bin, _)| bin.as_str()).collect();
    ensure!(
        bins == BTreeSet::from([
            "troupe-coordinator",
            "troupe-executor",
            "troupe-test-runner",
            "troupe-validator"
        ]),
        "every service is deployed: {bins:?}"
    );
    Ok(())
}

#[test]
fn the_dockerfile_passes_hadolint_and_sends_no_build_output() -> anyhow::Result<()> {
    let dockerfile = root().join("deploy/Dockerfile");
    run(&tool("hadolint"), &[&dockerfile.display().to_string()])?;
    let ignore = std::fs::read_to_string(root().join(".dockerignore"))?;
    let lines: BTreeSet<&str> = ignore.lines().map(str::trim).collect();
    for entry in ["target", ".git"] {
        ensure!(lines.contains(entry), ".dockerignore leaves out {entry}");
    }
    Ok(())
}

/// Renders `overlay` and returns its objects.
fn render(overlay: &str, dir: &Path) -> anyhow::Result<Vec<Value>> {
    let path = root().join("deploy/k8s/overlays").join(overlay);
    let rendered = run(
        &tool("kubectl"),
        &["kustomize", &path.display().to_string()],
    )?;
    let file = dir.join(format!("{overlay}.yaml"));
    std::fs::write(&file, rendered)?;
    objects(&file)
}

/// The step "Create the Secrets" of docs/kubernetes.md, run as written by bash, with a
/// `kubectl` that answers `--dry-run=client -o yaml` (no cluster) into a file: the Secrets it
/// makes validate strictly, and hold every key the pods read, by `secretKeyRef`, by a volume's
/// `items`, or as a file under a Secret volume that an argument or variable names.
#[test]
fn the_walkthrough_creates_every_secret_key_the_pods_read() -> anyhow::Result<()> {
    let kubectl = tool("kubectl");
    let doc = std::fs::read_to_string(root().join("docs/kubernetes.md"))?;
    let start = doc
        .find("## 2. Create the Secrets")
        .context("step 2 of docs/kubernetes.md")?;
    let end = doc[start..].find("\n## 3.").context("step 3")? + start;
    let blocks = crate::docs::code_blocks(&doc[start..end], "bash");
    ensure!(blocks.len() >= 4, "step 2 has its bash blocks");

    let dir = tempfile::tempdir()?;
    let work = dir.path().join("work");
    let bin = dir.path().join("bin");
    std::fs::create_dir_all(&work)?;
    std::fs::create_dir_all(&bin)?;
    std::os::unix::fs::symlink(root().join("examples"), work.join("examples"))?;
    let created = dir.path().join("created.yaml");
    let shim = bin.join("kubectl");
    std::fs::write(
        &shim,
        format!(
            "#!/bin/sh\n\"{}\" \"$@\" --dry-run=client -o yaml >> \"{}\" && echo --- >> \"{}\"\n",
            kubectl.display(),
            created.display(),
            created.display()
        ),
    )?;
    std::fs::set_permissions(&shim, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let path = std::env::join_paths(std::iter::once(bin.clone()).chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    )))?;
    for block in &blocks {
        let output = Command::new("bash")
            .args(["-euo", "pipefail", "-c", block])
            .current_dir(&work)
            .env("PATH", &path)
            .env("KUBECONFIG", dir.path().join("no-cluster"))
            .env("GIT_TOKEN", "git-token-for-the-test")
            .env("OPENAI_API_KEY", "sk-test-openai")
            .env("ANTHROPIC_API_KEY", "sk-test-anthropic")
            .output()?;
        ensure!(
            output.status.success(),
            "docs/kubernetes.md step 2 failed:\n{block}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    run(
        &tool("kubernetes-validate"),
        &["--strict", "--quiet", &created.display().to_string()],
    )?;
    let mut secrets: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for object in objects(&created)? {
        if object["kind"] == "Secret" {
            let keys = object["data"]
                .as_object()
                .map(|data| data.keys().cloned().collect())
                .unwrap_or_default();
            secrets.insert(
                object["metadata"]["name"].as_str().unwrap_or("").to_owned(),
                keys,
            );
        }
    }

    for overlay in ["dev", "prod"] {
        let objects = render(overlay, dir.path())?;
        let generated: BTreeSet<&str> = objects
            .iter()
            .filter(|o| o["kind"] == "Secret")
            .filter_map(|o| o["metadata"]["name"].as_str())
            .collect();
        let has = |secret: &str, key: &str| -> anyhow::Result<()> {
            if generated.contains(secret) {
                return Ok(());
            }
            let keys = secrets.get(secret).with_context(|| {
                format!("{overlay}: the walkthrough creates no Secret {secret}")
            })?;
            ensure!(
                keys.contains(key),
                "{overlay}: Secret {secret} has no key {key} (it has {keys:?})"
            );
            Ok(())
        };
        for workload in objects
            .iter()
            .filter(|o| o["kind"] == "Deployment" || o["kind"] == "StatefulSet")
        {
            let pod = &workload["spec"]["template"]["spec"];
            let mut mounted = BTreeMap::new();
            for volume in pod["volumes"].as_array().into_iter().flatten() {
                let Some(secret) = volume["secret"]["secretName"].as_str() else {
                    continue;
                };
                for item in volume["secret"]["items"].as_array().into_iter().flatten() {
                    has(secret, item["key"].as_str().unwrap_or(""))?;
                }
                mounted.insert(volume["name"].as_str().unwrap_or("").to_owned(), secret);
            }
            for container in pod["containers"].as_array().into_iter().flatten() {
                let mut named: Vec<String> = strings(&container["args"]);
                for env in container["env"].as_array().into_iter().flatten() {
                    named.extend(env["value"].as_str().map(str::to_owned));
                    let key_ref = &env["valueFrom"]["secretKeyRef"];
                    if let (Some(secret), Some(key)) =
                        (key_ref["name"].as_str(), key_ref["key"].as_str())
                    {
                        has(secret, key)?;
                    }
                }
                for env_from in container["envFrom"].as_array().into_iter().flatten() {
                    if let Some(secret) = env_from["secretRef"]["name"].as_str() {
                        ensure!(
                            generated.contains(secret) || secrets.contains_key(secret),
                            "{overlay}: the walkthrough creates no Secret {secret}"
                        );
                    }
                }
                for mount in container["volumeMounts"].as_array().into_iter().flatten() {
                    let Some(secret) = mount["name"].as_str().and_then(|v| mounted.get(v)) else {
                        continue;
                    };
                    let prefix = format!("{}/", mount["mountPath"].as_str().unwrap_or(""));
                    for file in named.iter().filter_map(|n| n.strip_prefix(&prefix)) {
                        has(secret, file)?;
                    }
                }
            }
        }
    }
    // The git rule's token file is a key of its Secret too.
    let rules = std::fs::read_to_string(work.join("git-credentials.toml"))?;
    for line in rules.lines() {
        if let Some(path) = line.strip_prefix("token_file = \"/etc/troupe/git/") {
            let key = path.trim_end_matches('"');
            ensure!(
                secrets["troupe-git"].contains(key),
                "troupe-git has no {key} for its rule"
            );
        }
    }
    Ok(())
}

/// The metric names an expression reads: each `troupe_…` word.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("troupe_") {
        let word: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + word.len()..];
        names.push(word);
    }
    names
}

/// The sample names a scrape's `# TYPE` lines promise (a histogram's `_bucket`, `_sum`,
/// `_count`), families with no series yet included.
async fn exported_names(addr: std::net::SocketAddr) -> anyhow::Result<BTreeSet<String>> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let text = reqwest::get(format!("http://{addr}/metrics"))
        .await?
        .error_for_status()?
        .text()
        .await?;
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let Some(declared) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut words = declared.split_whitespace();
        let (Some(name), Some(kind)) = (words.next(), words.next()) else {
            bail!("a TYPE line without a name and a type: {line}");
        };
        if kind == "histogram" {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{suffix}"));
            }
        } else {
            names.insert(name.to_owned());
        }
    }
    Ok(names)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grafana_dashboard_reads_only_metrics_the_binaries_export() -> anyhow::Result<()> {
    let text = std::fs::read_to_string(root().join("deploy/grafana/troupe.json"))?;
    let dashboard: Value = serde_json::from_str(&text).context("the dashboard is not JSON")?;
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().context("no panels")? {
        if panel["type"] == "row" {
            continue;
        }
        let targets = panel["targets"]
            .as_array()
            .with_context(|| format!("panel {} has no targets", panel["title"]))?;
        ensure!(
            !targets.is_empty(),
            "panel {} has no targets",
            panel["title"]
        );
        for target in targets {
            let expr = target["expr"].as_str().context("a target without expr")?;
            ensure!(
                !metric_names(expr).is_empty(),
                "panel {}: {expr} reads no troupe metric",
                panel["title"]
            );
            exprs.push((panel["title"].to_string(), expr.to_owned()));
        }
    }

    // What a real coordinator and a real executor worker serve (the worker families are the
    // same in every worker service).
    let data = tempfile::tempdir()?;
    let coordinator_metrics = free_addr();
    let coordinator_dir = data.path().join("coordinator").display().to_string();
    let coordinator = ChildService::start(
        "troupe-coordinator",
        &[
            "--data-dir",
            &coordinator_dir,
            "--metrics-listen",
            &coordinator_metrics.to_string(),
        ],
        &[],
    )
    .await?;
    let executor_metrics = free_addr();
    let executor_dir = data.path().join("executor").display().to_string();
    let executor = ChildService::start(
        "troupe-executor",
        &[
            "--data-dir",
            &executor_dir,
            "--coordinator-url",
            &coordinator.url(),
            "--metrics-listen",
            &executor_metrics.to_string(),
        ],
        &[],
    )
    .await?;
    let mut exported = exported_names(coordinator_metrics).await?;
    exported.extend(exported_names(executor_metrics).await?);
    executor
        .terminate(std::time::Duration::from_secs(20))
        .await?;
    coordinator
        .terminate(std::time::Duration::from_secs(20))
        .await?;

    let mut read = BTreeSet::new();
    for (panel, expr) in &exprs {
        for name in metric_names(expr) {
            ensure!(
                exported.contains(&name),
                "panel {panel} reads {name}, which no binary exports ({exported:?})"
            );
            read.insert(name);
        }
    }
    // Every family an operator needs is on the dashboard.
    for family in [
        "troupe_tasks_ready",
        "troupe_tasks",
        "troupe_task_pickup_seconds_bucket",
        "troupe_claim_duration_seconds_bucket",
        "troupe_task_duration_seconds_bucket",
        "troupe_task_attempts_total",
        "troupe_task_failures_total",
        "troupe_task_retries_total",
        "troupe_lease_expiries_total",
        "troupe_backend_fallbacks_total",
        "troupe_tokens_total",
        "troupe_cost_usd_total",
        "troupe_sandbox_denials_total",
        "troupe_test_pass_rate",
        "troupe_test_coverage_percent",
    ] {
        ensure!(
            read.contains(family),
            "the dashboard does not show {family}"
        );
    }
    Ok(())
}
