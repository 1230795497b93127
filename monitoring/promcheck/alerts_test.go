// The alerts of helm/twinmq/monitoring/twinmq-rules.yaml evaluated by Prometheus's own
// engine over series that mean trouble, and over series that do not: each alert's
// expression must return exactly the label sets expected (`for:` durations are not
// simulated: the expression is evaluated at one instant). Run by tests/test_monitoring.py
// (`go test` here); series are written in promtool's notation (`0+1x10`: 0, 1, ... 10,
// one sample a minute).
package main

import (
	"context"
	"log/slog"
	"os"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/prometheus/prometheus/promql/promqltest"
)

const rulesFile = "../../helm/twinmq/monitoring/twinmq-rules.yaml"

// The target labels a broker PodMonitor gives every series of one broker.
func broker(cluster, pod, name string) string {
	return `namespace="shop", brokercluster="` + cluster + `", pod="` + pod + `", broker="` + name + `"`
}

var (
	ordersPrimary = broker("orders", "orders-primary", "primary")
	ordersBackup  = broker("orders", "orders-backup", "backup")
	billingActive = broker("billing", "billing-primary", "primary")
)

type scenario struct {
	name  string
	alert string
	load  string   // series, one a line, 1m apart from time 0
	fires []string // the label sets the expression returns at 10m, as "k=v,k=v" sorted
}

var scenarios = []scenario{
	{"a pair with an active broker is fine", "TwinMQNoActiveBroker", `
		twinmq_role_active{` + ordersPrimary + `} 1x10
		twinmq_role_active{` + ordersBackup + `} 0x10
		up{` + ordersPrimary + `} 1x10
		up{` + ordersBackup + `} 1x10`, nil},
	{"two passive brokers: no active", "TwinMQNoActiveBroker", `
		twinmq_role_active{` + ordersPrimary + `} 0x10
		twinmq_role_active{` + ordersBackup + `} 0x10
		up{` + ordersPrimary + `} 1x10
		up{` + ordersBackup + `} 1x10`, []string{"brokercluster=orders,namespace=shop"}},
	{"the active broker unreachable, the other passive", "TwinMQNoActiveBroker", `
		twinmq_role_active{` + ordersBackup + `} 0x10
		up{` + ordersPrimary + `} 0x10
		up{` + ordersBackup + `} 1x10
		twinmq_role_active{` + billingActive + `} 1x10
		up{` + billingActive + `} 1x10`, []string{"brokercluster=orders,namespace=shop"}},
	{"both brokers unreachable", "TwinMQNoActiveBroker", `
		up{` + ordersPrimary + `} 0x10
		up{` + ordersBackup + `} 0x10`, []string{"brokercluster=orders,namespace=shop"}},
	{"a broker down", "TwinMQBrokerDown", `
		up{` + ordersPrimary + `} 1x10
		up{` + ordersBackup + `} 0x10`,
		[]string{"broker=backup,brokercluster=orders,namespace=shop,pod=orders-backup"}},
	{"confirming without a passive in sync", "TwinMQPairDegraded", `
		twinmq_replication_degraded{` + ordersPrimary + `} 1x10
		twinmq_replication_degraded{` + ordersBackup + `} 0x10
		twinmq_replication_degraded{` + billingActive + `} 0x10`,
		[]string{"brokercluster=orders,namespace=shop"}},
	{"replication lagging 15 s", "TwinMQReplicationLag", `
		twinmq_replication_lag_seconds{` + ordersPrimary + `} 15x10
		twinmq_replication_lag_seconds{` + billingActive + `} 0.2x10`,
		[]string{"brokercluster=orders,namespace=shop,pod=orders-primary"}},
	{"a disk alarm", "TwinMQResourceAlarm", `
		twinmq_alarm{resource="disk", ` + ordersPrimary + `} 1x10
		twinmq_alarm{resource="memory", ` + ordersPrimary + `} 0x10`,
		[]string{"brokercluster=orders,namespace=shop,pod=orders-primary,resource=disk"}},
	{"a damaged broker", "TwinMQBrokerDamaged", `
		twinmq_broker_damaged{` + ordersBackup + `} 1x10
		twinmq_broker_damaged{` + ordersPrimary + `} 0x10`,
		[]string{"brokercluster=orders,namespace=shop,pod=orders-backup"}},
	{"Lease renewals failing", "TwinMQLeaseNotRenewed", `
		twinmq_lease_renewal_failures_total{` + ordersPrimary + `} 0+1x10
		twinmq_lease_renewal_failures_total{` + ordersBackup + `} 2x10`,
		[]string{"brokercluster=orders,namespace=shop,pod=orders-primary"}},
	{"old Lease failures only", "TwinMQLeaseNotRenewed", `
		twinmq_lease_renewal_failures_total{` + ordersPrimary + `} 3x10`, nil},
	{"a self-fencing", "TwinMQSelfFenced", `
		twinmq_lease_self_fencings_total{` + ordersPrimary + `} 0 0 0 0 0 1 1 1 1 1 1`,
		[]string{"brokercluster=orders,namespace=shop,pod=orders-primary"}},
	{"a leader and a standby", "TwinMQOperatorDown", `
		twinmq_operator_leader{namespace="twinmq-system", pod="op-a"} 1x10
		twinmq_operator_leader{namespace="twinmq-system", pod="op-b"} 0x10`, nil},
	{"two standbys, no leader", "TwinMQOperatorDown", `
		twinmq_operator_leader{namespace="twinmq-system", pod="op-a"} 0x10
		twinmq_operator_leader{namespace="twinmq-system", pod="op-b"} 0x10`, []string{""}},
	{"no operator scraped at all", "TwinMQOperatorDown", `
		up{` + ordersPrimary + `} 1x10`, []string{""}},
	{"an audit FAIL", "TwinMQAuditFailed", `
		twinmq_operator_audits_total{verdict="FAIL", namespace="shop", brokercluster="orders", pod="op-a"} 0 0 0 0 0 1 1 1 1 1 1
		twinmq_operator_audits_total{verdict="PASS", namespace="shop", brokercluster="billing", pod="op-a"} 0+1x10`,
		[]string{"brokercluster=orders,namespace=shop"}},
	{"audits that passed", "TwinMQAuditFailed", `
		twinmq_operator_audits_total{verdict="PASS", namespace="shop", brokercluster="orders", pod="op-a"} 0+1x10`, nil},
	{"an audit that did not complete", "TwinMQAuditNotCompleted", `
		twinmq_operator_audits_total{verdict="ERROR", namespace="shop", brokercluster="orders", pod="op-a"} 0 0 0 0 0 1 1 1 1 1 1`,
		[]string{"brokercluster=orders,namespace=shop"}},
	{"a failover", "TwinMQFailover", `
		twinmq_operator_failovers_total{reason="active unreachable", pod="op-a"} 0 0 0 0 0 0 0 1 1 1 1`,
		[]string{"reason=active unreachable"}},
}

// loadCommand is promqltest's `load` of the scenario's series (indented, no blank line).
func loadCommand(series string) string {
	lines := []string{"load 1m"}
	for _, line := range strings.Split(series, "\n") {
		if line = strings.TrimSpace(line); line != "" {
			lines = append(lines, "  "+line)
		}
	}
	return strings.Join(lines, "\n")
}

func alertExpressions(t *testing.T) map[string]string {
	t.Helper()
	groups, errs := rulefmt.ParseFile(
		rulesFile, false, model.UTF8Validation, parser.NewParser(parser.Options{}),
		slog.New(slog.NewTextHandler(os.Stderr, nil)),
	)
	if len(errs) > 0 {
		t.Fatalf("%s: %v", rulesFile, errs)
	}
	out := map[string]string{}
	for _, group := range groups.Groups {
		for _, rule := range group.Rules {
			out[rule.Alert] = rule.Expr
		}
	}
	return out
}

func TestAlertsFireOnTroubleAndOnlyThen(t *testing.T) {
	expressions := alertExpressions(t)
	tested := map[string]bool{}
	for _, sc := range scenarios {
		t.Run(sc.alert+": "+sc.name, func(t *testing.T) {
			expr, ok := expressions[sc.alert]
			if !ok {
				t.Fatalf("no alert %s in %s", sc.alert, rulesFile)
			}
			tested[sc.alert] = true
			storage := promqltest.LoadedStorage(t, loadCommand(sc.load))
			engine := promqltest.NewTestEngine(t, false, 0, 100000)
			query, err := engine.NewInstantQuery(
				context.Background(), storage, nil, expr, time.Unix(0, 0).Add(10*time.Minute),
			)
			if err != nil {
				t.Fatal(err)
			}
			result := query.Exec(context.Background())
			if result.Err != nil {
				t.Fatal(result.Err)
			}
			vector, err := result.Vector()
			if err != nil {
				t.Fatal(err)
			}
			fired := []string{}
			for _, sample := range vector {
				pairs := []string{}
				sample.Metric.Range(func(label labels.Label) {
					if label.Name != labels.MetricName { // an alert drops the metric name
						pairs = append(pairs, label.Name+"="+label.Value)
					}
				})
				sort.Strings(pairs)
				fired = append(fired, strings.Join(pairs, ","))
			}
			sort.Strings(fired)
			want := append([]string{}, sc.fires...)
			sort.Strings(want)
			if strings.Join(fired, "|") != strings.Join(want, "|") || len(fired) != len(want) {
				t.Errorf("%s fired for %q, want %q\nexpr: %s", sc.alert, fired, want, expr)
			}
		})
	}
	for alert := range expressions {
		if !tested[alert] {
			t.Errorf("alert %s has no scenario", alert)
		}
	}
}
