// promcheck checks TwinMQ's Prometheus rules and dashboard queries with Prometheus's own
// parsers (the Go module github.com/prometheus/prometheus; no Python PromQL parser exists).
//
//	promcheck rules FILE   validate a rule file as Prometheus loads it (rulefmt, strict)
//	promcheck exprs        read a JSON list of PromQL expressions on stdin; print, for each,
//	                       the metric names it selects or the parse error, as JSON
//
// The exit status is 1 when a rule file is invalid; expression errors are reported in the
// output (the caller says which query they came from).
package main

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"sort"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
)

type exprResult struct {
	Expr    string   `json:"expr"`
	Error   string   `json:"error,omitempty"`
	Metrics []string `json:"metrics"`
}

func metricNames(expr parser.Expr) []string {
	seen := map[string]bool{}
	parser.Inspect(expr, func(node parser.Node, _ []parser.Node) error {
		if selector, ok := node.(*parser.VectorSelector); ok && selector.Name != "" {
			seen[selector.Name] = true
		}
		return nil
	})
	names := []string{}
	for name := range seen {
		names = append(names, name)
	}
	sort.Strings(names)
	return names
}

func checkRules(file string, p parser.Parser) int {
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil))
	_, errs := rulefmt.ParseFile(file, false, model.UTF8Validation, p, logger)
	for _, err := range errs {
		fmt.Println(err)
	}
	if len(errs) > 0 {
		return 1
	}
	return 0
}

func checkExprs(p parser.Parser) int {
	var exprs []string
	if err := json.NewDecoder(os.Stdin).Decode(&exprs); err != nil {
		fmt.Fprintln(os.Stderr, "stdin is not a JSON list of strings:", err)
		return 2
	}
	results := make([]exprResult, 0, len(exprs))
	for _, input := range exprs {
		result := exprResult{Expr: input, Metrics: []string{}}
		if expr, err := p.ParseExpr(input); err != nil {
			result.Error = err.Error()
		} else {
			result.Metrics = metricNames(expr)
		}
		results = append(results, result)
	}
	if err := json.NewEncoder(os.Stdout).Encode(results); err != nil {
		return 2
	}
	return 0
}

func main() {
	p := parser.NewParser(parser.Options{})
	switch {
	case len(os.Args) == 3 && os.Args[1] == "rules":
		os.Exit(checkRules(os.Args[2], p))
	case len(os.Args) == 2 && os.Args[1] == "exprs":
		os.Exit(checkExprs(p))
	default:
		fmt.Fprintln(os.Stderr, "usage: promcheck rules FILE | promcheck exprs < exprs.json")
		os.Exit(2)
	}
}
