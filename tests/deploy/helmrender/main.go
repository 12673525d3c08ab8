// helmrender renders a Helm chart's templates the way `helm template` does, for tests on a
// machine without helm: Go text/template with sprig, plus Helm's include, tpl, required,
// toYaml, fromYaml, toJson and fail; values from values.yaml deep-merged with -f files.
// Not covered: lookup, .Capabilities, .Files, subcharts, schema validation.
//
//	helmrender -chart deploy/helm/gengate -name gengate -namespace gengate [-f extra.yaml ...]
package main

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig/v3"
	"sigs.k8s.io/yaml"
)

type fileList []string

func (f *fileList) String() string     { return strings.Join(*f, ",") }
func (f *fileList) Set(v string) error { *f = append(*f, v); return nil }

func readYAML(path string) (map[string]interface{}, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	out := map[string]interface{}{}
	if err := yaml.Unmarshal(data, &out); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return out, nil
}

// merge deep-merges src into dst; a null in src deletes the key, as helm -f does.
func merge(dst, src map[string]interface{}) map[string]interface{} {
	for k, v := range src {
		if v == nil {
			delete(dst, k)
			continue
		}
		sv, sok := v.(map[string]interface{})
		dv, dok := dst[k].(map[string]interface{})
		if sok && dok {
			dst[k] = merge(dv, sv)
		} else {
			dst[k] = v
		}
	}
	return dst
}

func toYAML(v interface{}) string {
	data, err := yaml.Marshal(v)
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(string(data), "\n")
}

func main() {
	chart := flag.String("chart", "", "chart folder")
	name := flag.String("name", "release", "release name")
	namespace := flag.String("namespace", "default", "release namespace")
	var files fileList
	flag.Var(&files, "f", "values file merged over values.yaml (repeatable)")
	flag.Parse()
	if err := run(*chart, *name, *namespace, files); err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
		os.Exit(1)
	}
}

func run(chartDir, name, namespace string, files []string) error {
	meta, err := readYAML(filepath.Join(chartDir, "Chart.yaml"))
	if err != nil {
		return err
	}
	values, err := readYAML(filepath.Join(chartDir, "values.yaml"))
	if err != nil {
		return err
	}
	for _, f := range files {
		extra, err := readYAML(f)
		if err != nil {
			return err
		}
		values = merge(values, extra)
	}
	top := map[string]interface{}{
		"Values": values,
		"Release": map[string]interface{}{
			"Name": name, "Namespace": namespace, "Service": "Helm", "IsInstall": true, "Revision": 1,
		},
		"Chart": map[string]interface{}{
			"Name": meta["name"], "Version": meta["version"], "AppVersion": meta["appVersion"],
		},
	}

	root := template.New("chart")
	funcs := sprig.TxtFuncMap()
	delete(funcs, "env")
	delete(funcs, "expandenv")
	funcs["toYaml"] = toYAML
	funcs["toJson"] = func(v interface{}) string {
		data, _ := yaml.YAMLToJSON([]byte(toYAML(v)))
		return strings.TrimSpace(string(data))
	}
	funcs["fromYaml"] = func(s string) map[string]interface{} {
		out := map[string]interface{}{}
		_ = yaml.Unmarshal([]byte(s), &out)
		return out
	}
	funcs["required"] = func(msg string, v interface{}) (interface{}, error) {
		if v == nil || v == "" {
			return nil, fmt.Errorf("%s", msg)
		}
		return v, nil
	}
	funcs["fail"] = func(msg string) (string, error) { return "", fmt.Errorf("%s", msg) }
	funcs["include"] = func(n string, data interface{}) (string, error) {
		var buf bytes.Buffer
		err := root.ExecuteTemplate(&buf, n, data)
		return buf.String(), err
	}
	funcs["tpl"] = func(text string, data interface{}) (string, error) {
		t, err := root.Clone()
		if err != nil {
			return "", err
		}
		t, err = t.New("tpl").Parse(text)
		if err != nil {
			return "", err
		}
		var buf bytes.Buffer
		err = t.Execute(&buf, data)
		return buf.String(), err
	}
	root.Funcs(funcs).Option("missingkey=zero")

	paths, err := filepath.Glob(filepath.Join(chartDir, "templates", "*"))
	if err != nil {
		return err
	}
	sort.Strings(paths)
	chartName, _ := meta["name"].(string)
	for _, p := range paths {
		text, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		rel := chartName + "/templates/" + filepath.Base(p)
		if _, err := root.New(rel).Parse(string(text)); err != nil {
			return err
		}
	}
	var out strings.Builder
	for _, p := range paths {
		base := filepath.Base(p)
		if strings.HasPrefix(base, "_") {
			continue
		}
		rel := chartName + "/templates/" + base
		var buf bytes.Buffer
		if err := root.ExecuteTemplate(&buf, rel, top); err != nil {
			return err
		}
		rendered := strings.ReplaceAll(buf.String(), "<no value>", "")
		if base == "NOTES.txt" {
			fmt.Fprintf(os.Stderr, "%s", rendered)
			continue
		}
		if strings.TrimSpace(rendered) == "" {
			continue
		}
		fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", rel, strings.TrimSpace(rendered))
	}
	fmt.Print(out.String())
	return nil
}
