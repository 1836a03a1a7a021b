package dev.minikv;

/** How the heavy-hitter budget is spread over layers ({@code minikv_budget_policy}). */
public enum BudgetPolicy {
  /** Every layer keeps heavyRatio of its prompt. */
  UNIFORM(0),
  /** Lower layers keep more, linear from h(2-1/depth) to h/depth, mean h. */
  PYRAMID(1);

  final int code;

  BudgetPolicy(int code) {
    this.code = code;
  }

  static BudgetPolicy fromCode(int code) {
    for (BudgetPolicy p : values()) {
      if (p.code == code) {
        return p;
      }
    }
    throw new IllegalArgumentException("unknown minikv_budget_policy " + code);
  }
}
