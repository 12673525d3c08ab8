// helmrender renders and lints a Helm chart with Helm's own library (helm.sh/helm/v3), for
// tests on a machine without the helm binary. Rendering follows `helm template`: the chart
// loaded by Helm's loader, -f files merged the way `helm -f` merges them, values coalesced
// with the chart's (a null deletes a key) and validated against values.schema.json, the
// chart's kubeVersion checked against the target Kubernetes, templates rendered by Helm's
// engine (lookup answers empty, as in `helm template`) and the manifests split and ordered
// by Helm's release sorter. Linting follows `helm lint [--strict]`.
//
//	helmrender -chart deploy/helm/gengate -name gengate -namespace gengate [-f extra.yaml ...]
//	helmrender -lint [-strict] -chart deploy/helm/gengate [-f extra.yaml ...]
//
// Render: manifests on stdout, NOTES.txt on stderr, "Error: ..." on stderr and exit 1 on
// failure. Lint: messages on stdout, exit 1 when the chart fails (errors; warnings too with
// -strict).
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"runtime/debug"
	"strings"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	"helm.sh/helm/v3/pkg/releaseutil"
)

type listFlag []string

func (f *listFlag) String() string     { return strings.Join(*f, ",") }
func (f *listFlag) Set(v string) error { *f = append(*f, v); return nil }

type options struct {
	chart, name, namespace, kubeVersion string
	files, apiVersions                  listFlag
	lint, strict                        bool
}

func main() {
	var o options
	flag.StringVar(&o.chart, "chart", "", "chart folder")
	flag.StringVar(&o.name, "name", "release", "release name")
	flag.StringVar(&o.namespace, "namespace", "default", "release namespace")
	flag.StringVar(&o.kubeVersion, "kube-version", "", "Kubernetes version for .Capabilities, the chart's kubeVersion check and lint's deprecation rules (default: the helm binary's, from client-go)")
	flag.Var(&o.apiVersions, "api-versions", "extra API version for .Capabilities.APIVersions (repeatable)")
	flag.Var(&o.files, "f", "values file merged over values.yaml (repeatable)")
	flag.BoolVar(&o.lint, "lint", false, "lint the chart like `helm lint` instead of rendering it")
	flag.BoolVar(&o.strict, "strict", false, "with -lint: warnings fail too, like `helm lint --strict`")
	flag.Parse()
	if o.chart == "" || flag.NArg() > 0 {
		flag.Usage()
		os.Exit(2)
	}
	var err error
	if o.lint {
		err = runLint(o, os.Stdout)
	} else {
		err = render(o, os.Stdout, os.Stderr)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
		os.Exit(1)
	}
}

// mergeMaps merges b over a as `helm -f` does (pkg/cli/values): maps deep, anything else
// replaced, nulls kept so that coalescing with the chart's values deletes those keys.
func mergeMaps(a, b map[string]interface{}) map[string]interface{} {
	out := make(map[string]interface{}, len(a))
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		if vm, ok := v.(map[string]interface{}); ok {
			if am, ok := out[k].(map[string]interface{}); ok {
				out[k] = mergeMaps(am, vm)
				continue
			}
		}
		out[k] = v
	}
	return out
}

func userValues(files []string) (map[string]interface{}, error) {
	vals := map[string]interface{}{}
	for _, f := range files {
		v, err := chartutil.ReadValuesFile(f)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f, err)
		}
		vals = mergeMaps(vals, v.AsMap())
	}
	return vals, nil
}

// defaultKubeVersion is the Kubernetes version the helm binary assumes without a cluster or
// --kube-version: its Makefile sets it by -ldflags from the client-go it is built with
// (client-go v0.N.x is Kubernetes 1.N). Without those flags the library says 1.20, which this
// chart's kubeVersion refuses, so the same is derived here from this build's client-go.
func defaultKubeVersion() string {
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, dep := range info.Deps {
			var minor int
			if dep.Path == "k8s.io/client-go" {
				if _, err := fmt.Sscanf(dep.Version, "v0.%d.", &minor); err == nil {
					return fmt.Sprintf("v1.%d.0", minor)
				}
			}
		}
	}
	return chartutil.DefaultCapabilities.KubeVersion.Version
}

func kubeVersion(o options) (*chartutil.KubeVersion, error) {
	v := o.kubeVersion
	if v == "" {
		v = defaultKubeVersion()
	}
	return chartutil.ParseKubeVersion(v)
}

func capabilities(o options) (*chartutil.Capabilities, error) {
	caps := chartutil.DefaultCapabilities.Copy()
	kv, err := kubeVersion(o)
	if err != nil {
		return nil, err
	}
	caps.KubeVersion = *kv
	caps.APIVersions = append(caps.APIVersions, o.apiVersions...)
	return caps, nil
}

func render(o options, stdout, stderr io.Writer) error {
	chrt, err := loader.Load(o.chart)
	if err != nil {
		return err
	}
	if chrt.Metadata.Type == "library" {
		return errors.New("library charts are not installable")
	}
	vals, err := userValues(o.files)
	if err != nil {
		return err
	}
	if err := chartutil.ProcessDependenciesWithMerge(chrt, vals); err != nil {
		return err
	}
	caps, err := capabilities(o)
	if err != nil {
		return err
	}
	if c := chrt.Metadata.KubeVersion; c != "" && !chartutil.IsCompatibleRange(c, caps.KubeVersion.String()) {
		return fmt.Errorf("chart requires kubeVersion: %s which is incompatible with Kubernetes %s", c, caps.KubeVersion.String())
	}
	release := chartutil.ReleaseOptions{Name: o.name, Namespace: o.namespace, Revision: 1, IsInstall: true}
	top, err := chartutil.ToRenderValues(chrt, vals, release, caps) // coalesces, then checks the schema
	if err != nil {
		return err
	}
	var e engine.Engine
	files, err := e.Render(chrt, top)
	if err != nil {
		return err
	}
	notes := path.Join(chrt.Name(), "templates", "NOTES.txt")
	for name, text := range files {
		if strings.HasSuffix(name, "NOTES.txt") {
			if name == notes {
				fmt.Fprint(stderr, text)
			}
			delete(files, name)
		}
	}
	hooks, manifests, err := releaseutil.SortManifests(files, caps.APIVersions, releaseutil.InstallOrder)
	if err != nil {
		return err
	}
	var out strings.Builder
	for _, crd := range chrt.CRDObjects() {
		fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", crd.Filename, string(crd.File.Data))
	}
	for _, m := range manifests {
		fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", m.Name, m.Content)
	}
	for _, h := range hooks {
		fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", h.Path, h.Manifest)
	}
	_, err = io.WriteString(stdout, out.String())
	return err
}

// runLint is `helm lint` (pkg/action.Lint without the tarball handling): every rule of
// pkg/lint, failing on errors, and on warnings too when strict.
func runLint(o options, stdout io.Writer) error {
	vals, err := userValues(o.files)
	if err != nil {
		return err
	}
	kv, err := kubeVersion(o)
	if err != nil {
		return err
	}
	if _, err := os.Stat(path.Join(o.chart, "Chart.yaml")); err != nil {
		return fmt.Errorf("unable to check Chart.yaml file in chart: %w", err)
	}
	linter := lint.AllWithKubeVersionAndSchemaValidation(o.chart, vals, o.namespace, kv, false)
	lowest, level := support.ErrorSev, "errors"
	if o.strict {
		lowest, level = support.WarningSev, "warnings or errors"
	}
	fmt.Fprintf(stdout, "==> Linting %s\n", o.chart)
	failed := 0
	for _, msg := range linter.Messages {
		fmt.Fprintln(stdout, msg)
		if msg.Severity >= lowest {
			failed++
		}
	}
	if failed > 0 {
		return fmt.Errorf("%s: %d lint message(s) are %s: 1 chart(s) linted, 1 chart(s) failed", o.chart, failed, level)
	}
	fmt.Fprintln(stdout, "1 chart(s) linted, 0 chart(s) failed")
	return nil
}
