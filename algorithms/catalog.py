"""What each algorithm is and where it comes from, as plain data (no torch, no Ray).

``dpfl algorithms`` prints this table without importing the training code, so it answers
in well under a second. :mod:`algorithms.recipes` takes each recipe's summary, privacy
flag and citation from here, so the two cannot drift apart. Every arXiv id below was
checked against the paper's arXiv listing; what a private recipe computes and where it
departs from its paper is in ``docs/algorithms.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Venue of a paper known only from arXiv (no peer-reviewed venue verified).
PREPRINT = "arXiv preprint"


@dataclass(frozen=True)
class Paper:
    """One publication: enough to find it (title, authors, venue, year, arXiv id)."""

    title: str
    authors: str
    venue: str
    year: int
    arxiv: str

    @property
    def first_author(self) -> str:
        return self.authors.split(",")[0].split()[-1]

    def short(self) -> str:
        """``McMahan et al., ICLR 2018, arXiv:1710.06963``."""
        etal = " et al." if "," in self.authors else ""
        if self.venue == PREPRINT:
            return f"{self.first_author}{etal} {self.year}, arXiv:{self.arxiv}"
        return f"{self.first_author}{etal}, {self.venue} {self.year}, arXiv:{self.arxiv}"

    def full(self) -> str:
        """Title, authors, venue and year, arXiv id."""
        return f'"{self.title}". {self.authors}. {self.venue} {self.year}. arXiv:{self.arxiv}'


PAPERS: dict[str, Paper] = {
    "fedavg": Paper(
        "Communication-Efficient Learning of Deep Networks from Decentralized Data",
        "H. Brendan McMahan, Eider Moore, Daniel Ramage, Seth Hampson, Blaise Agüera y Arcas",
        "AISTATS",
        2017,
        "1602.05629",
    ),
    "fedsam": Paper(
        "Generalized Federated Learning via Sharpness Aware Minimization",
        "Zhe Qu, Xingyu Li, Rui Duan, Yao Liu, Bo Tang, Zhuo Lu",
        "ICML",
        2022,
        "2206.02618",
    ),
    "dp_fedavg": Paper(
        "Learning Differentially Private Recurrent Language Models",
        "H. Brendan McMahan, Daniel Ramage, Kunal Talwar, Li Zhang",
        "ICLR",
        2018,
        "1710.06963",
    ),
    "blur_lus": Paper(
        "Differentially Private Federated Learning with Local Regularization and Sparsification",
        "Anda Cheng, Peisong Wang, Xi Sheryl Zhang, Jian Cheng",
        "CVPR",
        2022,
        "2203.03106",
    ),
    "fedsmp": Paper(
        "Federated Learning with Sparsified Model Perturbation: Improving Accuracy under "
        "Client-Level Differential Privacy",
        "Rui Hu, Yanmin Gong, Yuanxiong Guo",
        PREPRINT,
        2022,
        "2202.07178",
    ),
    "dp_fed_ls": Paper(
        # arXiv v1 was titled "Exploring Private Federated Learning with Laplacian Smoothing"
        "Differentially Private Federated Learning with Laplacian Smoothing",
        "Zhicong Liang, Bao Wang, Quanquan Gu, Stanley Osher, Yuan Yao",
        PREPRINT,
        2020,
        "2005.00218",
    ),
    "dp_fedsam": Paper(
        "Make Landscape Flatter in Differentially Private Federated Learning",
        "Yifan Shi, Yingqi Liu, Kang Wei, Li Shen, Xueqian Wang, Dacheng Tao",
        "CVPR",
        2023,
        "2303.11242",
    ),
    "dp_fedsam_topk": Paper(
        "Towards the Flatter Landscape and Better Generalization in Federated Learning "
        "under Client-level Differential Privacy",
        "Yifan Shi, Kang Wei, Li Shen, Yingqi Liu, Xueqian Wang, Bo Yuan, Dacheng Tao",
        PREPRINT,
        2023,
        "2305.00873",
    ),
    "dp2_fedsam": Paper(
        "DP²-FedSAM: Enhancing Differentially Private Federated Learning Through "
        "Personalized Sharpness-Aware Minimization",
        "Zhenxiao Zhang, Yuanxiong Guo, Yanmin Gong",
        PREPRINT,
        2024,
        "2409.13645",
    ),
    "dp_fedpgn": Paper(
        "DP-FedPGN: Finding Global Flat Minima for Differentially Private Federated "
        "Learning via Penalizing Gradient Norm",
        "Junkang Liu, Yuxuan Tian, Fanhua Shang, Hongying Liu, Yuanyuan Liu, Junchao Zhou, "
        "Daorui Ding",
        PREPRINT,
        2025,
        "2510.27504",
    ),
    "dp_ftrl": Paper(
        "Practical and Private (Deep) Learning without Sampling or Shuffling",
        "Peter Kairouz, Brendan McMahan, Shuang Song, Om Thakkar, Abhradeep Thakurta, Zheng Xu",
        "ICML",
        2021,
        "2103.00039",
    ),
    "dp_bandmf": Paper(
        "(Amplified) Banded Matrix Factorization: A unified approach to private training",
        "Christopher A. Choquette-Choo, Arun Ganesh, Ryan McKenna, H. Brendan McMahan, "
        "Keith Rush, Abhradeep Thakurta, Zheng Xu",
        "NeurIPS",
        2023,
        "2306.08153",
    ),
}


@dataclass(frozen=True)
class Entry:
    """One algorithm as ``dpfl algorithms`` lists it."""

    name: str
    summary: str
    private: bool
    papers: tuple[str, ...]  # keys of PAPERS, the method's own paper first
    section: int  # docs/algorithms.md §N
    # A personalised recipe (parts of the model stay on the client): its metric needs a
    # held-out split of each client's data (engine.config: dataset.client_test_fraction).
    personal: bool = False

    def citation(self) -> str:
        return "; ".join(PAPERS[k].short() for k in self.papers)


CATALOG: dict[str, Entry] = {
    e.name: e
    for e in (
        Entry("fedavg", "FedAvg: local SGD, server averages the updates", False, ("fedavg",), 1),
        Entry(
            "fedsam",
            "FedSAM: FedAvg with SAM/ASAM local steps (not private)",
            False,
            ("fedsam",),
            1,
        ),
        Entry(
            "dp_fedavg",
            "DP-FedAvg: whole-update clip, central Gaussian noise",
            True,
            ("dp_fedavg",),
            1,
        ),
        Entry(
            "dp_fedavg_blur",
            "DP-FedAvg + BLUR: penalise local updates longer than C",
            True,
            ("blur_lus",),
            2,
        ),
        Entry(
            "dp_fedavg_blur_lus",
            "DP-FedAvg + BLUR + LUS: zero unimportant coordinates",
            True,
            ("blur_lus",),
            2,
        ),
        Entry(
            "fedsmp_randk",
            "Fed-SMP rand-k: public random mask, noise on k coords",
            True,
            ("fedsmp",),
            3,
        ),
        Entry(
            "fedsmp_topk",
            "Fed-SMP top-k: local top-k before clipping",
            True,
            ("fedsmp",),
            3,
        ),
        Entry(
            "dp_fed_ls",
            "DP-Fed-LS: ball-projected local SGD, Laplacian-smoothed aggregate",
            True,
            ("dp_fed_ls",),
            4,
        ),
        Entry(
            "dp_fedsam",
            "DP-FedSAM: SAM/ASAM local steps, whole-update clip + noise",
            True,
            ("dp_fedsam",),
            5,
        ),
        Entry(
            "dp_fedsam_topk",
            "DP-FedSAM-top_k: top-k of the noisy aggregate",
            True,
            ("dp_fedsam_topk",),
            5,
        ),
        Entry(
            "dp2_fedsam",
            "DP²-FedSAM: personal heads stay local, SAM on the shared body",
            True,
            ("dp2_fedsam",),
            6,
            personal=True,
        ),
        Entry(
            "dp_fedpgn",
            "DP-FedPGN: global-gradient-aware perturbation and mixing",
            True,
            ("dp_fedpgn",),
            7,
        ),
        Entry(
            "dp_fedpgn_ls",
            "DP-FedPGN-LS: DP-FedPGN with a smoothed direction g̃",
            True,
            ("dp_fedpgn", "dp_fed_ls"),
            7,
        ),
        Entry(
            "dp_ftrl",
            "DP-FTRL: tree-aggregated noise on prefix sums, epochs without sampling",
            True,
            ("dp_ftrl",),
            11,
        ),
        Entry(
            "dp_bandmf",
            "DP-BandMF: b-banded correlated noise, b-min-separated participation",
            True,
            ("dp_bandmf",),
            12,
        ),
    )
}


def references() -> list[str]:
    """Every paper once, in catalog order, as full references."""
    seen: list[str] = []
    for e in CATALOG.values():
        for k in e.papers:
            if k not in seen:
                seen.append(k)
    return [f"[{k}] {PAPERS[k].full()}" for k in seen]
